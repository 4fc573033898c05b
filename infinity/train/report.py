"""What a run leaves behind besides the model: the metrics file, the summary table, and with
--report a PNG of the run and the Perfetto trace of one step."""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence

from infinity.engine import Engine
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


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3f} GB"


def summary(records: Sequence[StepRecord], *, peak_rss_bytes: int, requested_steps: int) -> str:
    """A small table: steps, loss first -> last (and the fall), speed, memory, NVMe traffic."""
    if not records:
        return "no step ran"
    first, last = records[0], records[-1]
    steady = records[1:] or records  # the first step also records the traces
    step_s = sorted(r.step_s for r in steady)[len(steady) // 2]
    tokens = sum(r.tokens for r in records)
    nvme = sum(last.moved_bytes.get(d, 0) for d in ("host->nvme", "nvme->host"))
    fall = first.loss - last.loss
    rows = [
        ("steps", f"{len(records)} of {requested_steps}"),
        ("loss", f"{first.loss:.4f} -> {last.loss:.4f} (fell by {fall:.4f}, "
                 f"{100 * fall / first.loss:.1f}%)" if first.loss else f"{first.loss} -> {last.loss}"),
        ("tokens", f"{tokens} in {last.elapsed_s:.1f} s ({tokens / last.elapsed_s:.0f} tokens/s)"),
        ("step time", f"median {step_s:.3f} s (first step {first.step_s:.3f} s)"),
        ("peak RSS", f"{peak_rss_bytes / 2**20:.0f} MiB"),
        ("NVMe traffic", f"{_gb(nvme)} ({nvme / last.elapsed_s / 1e9:.3f} GB/s over the run)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def plot(records: Sequence[StepRecord], path: str | os.PathLike[str]) -> None:
    """PNG with three panels over the steps: loss, step time, bytes used per store tier."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    steps = [r.step for r in records]
    fig, (loss, time, tiers) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    loss.plot(steps, [r.loss for r in records])
    loss.set_ylabel("loss")
    time.plot(steps, [r.step_s for r in records])
    time.set_ylabel("step time (s)")
    for tier in records[0].tier_used_bytes if records else ():
        tiers.plot(steps, [r.tier_used_bytes.get(tier, 0) / 2**20 for r in records], label=tier)
    tiers.set_ylabel("store bytes used (MiB)")
    tiers.set_xlabel("step")
    tiers.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_step_trace(engine: Engine, path: str | os.PathLike[str], record: StepRecord) -> None:
    """The engine's Perfetto trace cut to the step of `record` (events inside its time span)."""
    engine.write_trace(path)
    with open(path) as f:
        trace = json.load(f)
    start_us = (record.clock_s - record.step_s - engine.timeline.t0) * 1e6 - SLACK_US
    end_us = (record.clock_s - engine.timeline.t0) * 1e6 + SLACK_US
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("ph") != "X"
                            or start_us <= e["ts"] and e["ts"] + e.get("dur", 0) <= end_us]
    with open(path, "w") as f:
        json.dump(trace, f)
