"""Loss curves of infinity-train runs in several optimizer state formats, one panel per seed,
and the figures of docs/performance.md "Optimizer state formats": each run's last-20-step mean
loss against the panel's first run, and its loss at steps 100, 200 and 300.

    python -m tools.plot_optimizer_state --out docs/img/optimizer_state_loss.png \\
        --run "seed 0" "fp32 / fp32" runs/s0-fp32 --run "seed 0" "int8 / none" runs/s0-int8n ...

Each --run names a panel, a label and a run's output directory (its metrics.jsonl). The curves
are running means over `--window` steps (the raw per-step loss of 8 x 128 tokens is noisy).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
from typing import Any

from infinity.train.report import read_history

LAST = 20  # the measure: the mean loss of the last 20 steps
TICKS = (0.8, 1, 1.5, 2, 3, 4, 6)  # loss axis (log scale)
SETTLED = 9  # bytes moved are counted from step 10 (the first steps set up the store)


def running_mean(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def history_of(run_dir: pathlib.Path) -> list[dict[str, Any]]:
    history = read_history(run_dir / "metrics.jsonl")
    if not history:
        raise SystemExit(f"plot_optimizer_state: no step records in {run_dir / 'metrics.jsonl'}")
    return history


def moved_per_step(history: list[dict[str, Any]]) -> float:
    """NVMe bytes read and written a step, from the store's counters after the first steps."""
    first, last = history[min(SETTLED, len(history) - 1)], history[-1]
    steps = max(1, last["step"] - first["step"])
    return (sum(last["moved_bytes"].values()) - sum(first["moved_bytes"].values())) / steps


def table(panels: dict[str, list[tuple[str, list[dict[str, Any]]]]]) -> str:
    """One markdown row per run: its last-20 mean, against the panel's first run, its loss at
    steps 100 / 200 / 300 (where the run has them), the NVMe bytes of parameters and state, the
    bytes moved a step and the median step time."""
    rows = ["| seed | moments / master | last-20 mean | vs first | loss at 100 / 200 / 300 | "
            "NVMe used | moved a step | median step |",
            "|---|---|---:|---:|---|---:|---:|---:|"]
    for panel, runs in panels.items():
        base = statistics.fmean([r["loss"] for r in runs[0][1][-LAST:]])
        for label, history in runs:
            loss = [r["loss"] for r in history]
            mean = statistics.fmean(loss[-LAST:])
            at = " / ".join(f"{loss[s - 1]:.3f}" for s in (100, 200, 300) if s <= len(loss))
            rel = "" if history is runs[0][1] else f"{100 * (mean / base - 1):+.1f}%"
            used = history[-1].get("tier_used_bytes", {}).get("nvme", 0) / 1e6
            step = statistics.median(r["step_s"] for r in history)
            rows.append(f"| {panel} | {label} | {mean:.4f} | {rel} | {at} | {used:.2f} MB | "
                        f"{moved_per_step(history) / 1e6:.2f} MB | {step:.2f} s |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", nargs=3, action="append", required=True,
                   metavar=("PANEL", "LABEL", "DIR"), help="a run: panel, label, output dir")
    p.add_argument("--out", type=pathlib.Path, required=True, help="the PNG to write")
    p.add_argument("--window", type=int, default=10, help="running mean over N steps")
    args = p.parse_args(argv)
    panels: dict[str, list[tuple[str, list[dict[str, Any]]]]] = {}
    for panel, label, run_dir in args.run:
        panels.setdefault(panel, []).append((label, history_of(pathlib.Path(run_dir))))
    print(table(panels))

    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import NullFormatter

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), sharey=True,
                             squeeze=False)
    for ax, (panel, runs) in zip(axes[0], panels.items(), strict=True):
        for label, history in runs:
            ax.plot([r["step"] for r in history],
                    running_mean([r["loss"] for r in history], args.window), label=label,
                    linewidth=1)
        ax.set_yscale("log")
        ax.set_yticks(TICKS, [f"{t:g}" for t in TICKS])
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel(f"loss ({args.window}-step running mean)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=80)
    plt.close(fig)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
