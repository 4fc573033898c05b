"""What a run leaves behind besides the model: the metrics file, the summary table, and with
--report a PNG of the run and the Perfetto trace of one step."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import statistics
from collections.abc import Sequence
from typing import Any

from infinity.engine import Engine
from infinity.errors import InputError
from infinity.train.loop import StepRecord

SLACK_US = 1000.0  # the store's trace clock starts up to this much after the engine's


class MetricsFile:
    """One JSON line per step, flushed as it comes (a run stopped midway keeps its lines)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        self._file = self.path.open("a")

    def write(self, record: StepRecord) -> None:
        self._file.write(json.dumps(record.as_json()) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read_history(path: pathlib.Path) -> list[dict[str, Any]]:
    """Every step line of a metrics.jsonl (a resumed run's earlier steps included); lines
    that are not a step's record are skipped."""
    history = []
    with contextlib.suppress(OSError), path.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    history.append(record)
    return history


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3f} GB"


def _evals(records: Sequence[StepRecord]) -> list[StepRecord]:
    return [r for r in records if r.eval_loss is not None]


def summary(records: Sequence[StepRecord], *, peak_rss_bytes: int, requested_steps: int) -> str:
    """A small table: steps, loss first -> last (and the fall), evaluation, speed, memory, NVMe
    traffic."""
    if not records:
        return "no step ran"
    first, last = records[0], records[-1]
    steady = records[1:] or records  # the first step also records the traces
    step_s = sorted(r.step_s for r in steady)[len(steady) // 2]
    tokens = sum(r.tokens for r in records)
    trained = sum(r.trained_tokens for r in records)
    nvme = sum(last.moved_bytes.get(d, 0) for d in ("host->nvme", "nvme->host"))
    fall = first.loss - last.loss
    rows = [
        ("steps", f"{last.step} of {requested_steps}" + (
            f" ({len(records)} in this run)" if first.step > 1 else "")),
        ("loss", f"{first.loss:.4f} -> {last.loss:.4f} (fell by {fall:.4f}, "
                 f"{100 * fall / first.loss:.1f}%)"
                 if first.loss else f"{first.loss} -> {last.loss}"),
    ]
    evals = _evals(records)
    if evals:
        rows.append(("eval loss", f"{evals[0].eval_loss:.4f} -> {evals[-1].eval_loss:.4f} "
                                  f"(perplexity {evals[-1].eval_perplexity:.2f} at step "
                                  f"{evals[-1].step})"))
    rows += [
        ("tokens", f"{tokens} in {last.elapsed_s:.1f} s ({tokens / last.elapsed_s:.0f} tokens/s)"
                   + f", {trained} of them trained (targets of the loss)"),
        ("step time", f"median {step_s:.3f} s (first step {first.step_s:.3f} s)"),
        ("peak RSS", f"{peak_rss_bytes / 2**20:.0f} MiB"),
        ("NVMe traffic", f"{_gb(nvme)} ({nvme / last.elapsed_s / 1e9:.3f} GB/s over the run)"),
    ]
    paused = [r.disk_paused_s for r in records if r.disk_paused_s is not None]
    if paused:  # [Note: a disk that pauses] in aio/device_pauses.py
        rows.append(("disk paused", f"{sum(paused):.1f} s of the steps' "
                                    f"{sum(r.step_s for r in records):.1f} s (busy, moving "
                                    "almost nothing; other processes' I/O counts)"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _smoothed(values: Sequence[float], window: int = 9) -> list[float]:
    """Running median over `window` steps (centred): step time without its spikes."""
    half = window // 2
    return [statistics.median(values[max(0, i - half):i + half + 1]) for i in range(len(values))]


def plot(history: Sequence[dict[str, Any]], path: str | os.PathLike[str], *,
         budgets: dict[str, int] | None = None) -> None:
    """`figure` as a PNG."""
    fig = figure(history, budgets=budgets)
    from matplotlib import pyplot as plt

    fig.savefig(path, dpi=100)
    plt.close(fig)


def figure(history: Sequence[dict[str, Any]], *, budgets: dict[str, int] | None = None) -> Any:
    """The figure of a run over its steps (`history`: metrics.jsonl's records, a resumed run's
    earlier steps included): loss (and evaluation loss), learning rate, step time (raw, faint, and a
    running median), tokens/s, NVMe GB/s, resident memory, gradient norm, and bytes used per
    store tier from 0 with each tier's budget."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in history]

    def series(key: str) -> list[float]:
        return [float("nan") if r.get(key) is None else r[key] for r in history]

    fig, axes = plt.subplots(4, 2, figsize=(12, 12), sharex=True)
    (loss, lr), (time, speed), (nvme, rss), (norm, tiers) = axes
    loss.plot(steps, series("loss"), label="train")
    evaluated = [r for r in history if r.get("eval_loss") is not None]
    if evaluated:
        loss.plot([r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated], "o-",
                  label="eval")
        loss.legend()
    loss.set_ylabel("loss")
    lr.plot(steps, series("lr"))
    lr.set_ylabel("learning rate")
    raw = series("step_s")
    time.plot(steps, raw, alpha=0.3, label="raw")
    time.plot(steps, _smoothed(raw), label="running median")
    time.set_ylabel("step time (s)")
    time.legend()
    speed.plot(steps, series("tokens_per_s"))
    speed.set_ylabel("tokens/s")
    nvme.plot(steps, series("nvme_gbps"))
    nvme.set_ylabel("NVMe GB/s")
    rss.plot(steps, [v / 2**20 for v in series("rss_bytes")])
    rss.set_ylabel("resident memory (MiB)")
    norm.plot(steps, series("grad_norm"))
    norm.set_ylabel("gradient norm")
    if all(r.get("grad_norm") is None for r in history):
        norm.text(0.5, 0.5, "not taken (no clipping: the optimizer\nsteps units during backward)",
                  ha="center", va="center", transform=norm.transAxes)
    for tier in history[-1].get("tier_used_bytes", {}) if history else ():
        line = tiers.plot(steps, [r.get("tier_used_bytes", {}).get(tier, 0) / 2**20
                                  for r in history], label=tier)[0]
        if budgets and tier in budgets:
            tiers.axhline(budgets[tier] / 2**20, color=line.get_color(), linestyle="--",
                          label=f"{tier} budget")
    tiers.set_ylim(bottom=0)
    tiers.set_ylabel("store bytes used (MiB)")
    tiers.legend()
    for ax in axes[-1]:
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig


SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
           "tokens_per_s": "speed/tokens_per_s", "step_s": "speed/step_s",
           "nvme_gbps": "speed/nvme_gbps", "disk_paused_s": "speed/disk_paused_s",
           "rss_bytes": "memory/rss_bytes",
           "trained_tokens": "train/trained_tokens", "eval_loss": "eval/loss",
           "eval_perplexity": "eval/perplexity"}  # StepRecord field -> TensorBoard tag
REPORTERS = ("tensorboard",)


def tensorboard_writer(logdir: pathlib.Path) -> Any:
    """torch's TensorBoard SummaryWriter on `logdir` (needs the tensorboard package)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise InputError("--report-to tensorboard needs the tensorboard package "
                         "(pip install tensorboard)") from None
    return SummaryWriter(str(logdir))


def write_scalars(writer: Any, record: StepRecord) -> None:
    """A step's figures as TensorBoard scalars (what is None is left out)."""
    for name, tag in SCALARS.items():
        value = getattr(record, name)
        if value is not None:
            writer.add_scalar(tag, value, record.step)
    writer.flush()


PROCESS_NAMES = {1: "store moves", 2: "engine"}  # the trace's processes (store, timeline)


def write_step_trace(engine: Engine, path: str | os.PathLike[str], record: StepRecord) -> None:
    """The engine's Perfetto trace cut to the step of `record` (events inside its time span),
    every process named."""
    engine.write_trace(path)
    with open(path) as f:
        trace = json.load(f)
    start_us = (record.clock_s - record.step_s - engine.timeline.t0) * 1e6 - SLACK_US
    end_us = (record.clock_s - engine.timeline.t0) * 1e6 + SLACK_US
    events = [e for e in trace["traceEvents"] if e.get("ph") != "X"
              or start_us <= e["ts"] and e["ts"] + e.get("dur", 0) <= end_us]
    named = {e.get("pid") for e in events if e.get("name") == "process_name"}
    events += [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": name}}
               for pid, name in PROCESS_NAMES.items() if pid not in named]
    trace["traceEvents"] = events
    with open(path, "w") as f:
        json.dump(trace, f)
