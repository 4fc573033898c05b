"""Loss curves of infinity-train runs in several optimizer state formats, one panel per seed,
and the figures of docs/performance.md "Optimizer state formats": each run's last-20-step mean
loss against the panel's first run, its loss at steps 100, 200 and 300, a summary over the
panels (seeds) of each format, and the paired gaps' mean, standard error and median.

    python -m tools.plot_optimizer_state --out docs/img/optimizer_state_loss.png \\
        --run "seed 0" "fp32 / fp32" runs/s0-fp32 --run "seed 0" "int8 / none" runs/s0-int8n ...

Each --run names a panel, a label and a run's output directory (its metrics.jsonl). The curves
are running means over `--window` steps (the raw per-step loss of 8 x 128 tokens is noisy).
With --ratio-panel, one more panel draws each label's curve over its panel's first run's, the
ratio averaged over the panels holding both: a gap of a few percent, which the log-scale loss
panels cannot show, and whether it opens or closes as the runs go on.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
from typing import Any

from infinity.train.report import read_history

LAST = 20  # the measure: the mean loss of the last 20 steps
TICKS = (0.6, 0.7, 0.8, 1, 1.5, 2, 3, 4, 6)  # loss axis (log scale)
SETTLED = 9  # bytes moved are counted from step 10 (the first steps set up the store)

Runs = list[tuple[str, list[dict[str, Any]]]]  # (label, step records) of one panel, base first


def running_mean(values: list[float], window: int) -> list[float]:
    return [statistics.fmean(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def history_of(run_dir: pathlib.Path) -> list[dict[str, Any]]:
    history = read_history(run_dir / "metrics.jsonl")
    if not history:
        raise SystemExit(f"plot_optimizer_state: no step records in {run_dir / 'metrics.jsonl'}")
    return history


def last_mean(history: list[dict[str, Any]]) -> float:
    return statistics.fmean(r["loss"] for r in history[-LAST:])


def moved_per_step(history: list[dict[str, Any]]) -> float:
    """NVMe bytes read and written a step, from the store's counters after the first steps."""
    first, last = history[min(SETTLED, len(history) - 1)], history[-1]
    steps = max(1, last["step"] - first["step"])
    return (sum(last["moved_bytes"].values()) - sum(first["moved_bytes"].values())) / steps


def table(panels: dict[str, Runs]) -> str:
    """One markdown row per run: its last-20 mean, against the panel's first run, its loss at
    steps 100 / 200 / 300 (where the run has them), the NVMe bytes of parameters and state, the
    bytes moved a step and the median step time."""
    rows = ["| seed | moments / master | last-20 mean | vs first | loss at 100 / 200 / 300 | "
            "NVMe used | moved a step | median step |",
            "|---|---|---:|---:|---|---:|---:|---:|"]
    for panel, runs in panels.items():
        base = last_mean(runs[0][1])
        for label, history in runs:
            loss = [r["loss"] for r in history]
            mean = last_mean(history)
            at = " / ".join(f"{loss[s - 1]:.3f}" for s in (100, 200, 300) if s <= len(loss))
            rel = "" if history is runs[0][1] else f"{100 * (mean / base - 1):+.1f}%"
            used = history[-1].get("tier_used_bytes", {}).get("nvme", 0) / 1e6
            step = statistics.median(r["step_s"] for r in history)
            rows.append(f"| {panel} | {label} | {mean:.4f} | {rel} | {at} | {used:.2f} MB | "
                        f"{moved_per_step(history) / 1e6:.2f} MB | {step:.2f} s |")
    return "\n".join(rows)


def summary(panels: dict[str, Runs]) -> str:
    """One markdown row per label over the panels: in each panel its last-20 mean against the
    panel's first run (the first run's own last-20 mean in its row; blank where the panel lacks
    the label), then the mean of its last-20 means over the panels holding it, against the
    mean of the first runs of the same panels, and how many panels that is."""
    labels = list(dict.fromkeys(label for runs in panels.values() for label, _ in runs))
    rows = ["| moments / master | " + " | ".join(panels) + " | mean last-20 | vs first | n |",
            "|---|" + "---:|" * (len(panels) + 3)]
    for label in labels:
        cells, means, bases, is_base = [], [], [], True
        for runs in panels.values():
            found = [h for name, h in runs if name == label]
            if not found:
                cells.append("")
                continue
            base, mean = last_mean(runs[0][1]), last_mean(found[0])
            means.append(mean)
            bases.append(base)
            first = found[0] is runs[0][1]
            is_base &= first
            cells.append(f"{mean:.4f}" if first else f"{100 * (mean / base - 1):+.1f}%")
        mean, base = statistics.fmean(means), statistics.fmean(bases)
        rel = "" if is_base else f"{100 * (mean / base - 1):+.1f}%"
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {mean:.4f} | {rel} | "
                    f"{len(means)} |")
    return "\n".join(rows)


def paired(panels: dict[str, Runs]) -> str:
    """One markdown row per label but each panel's first: its per-panel gaps against the
    panel's first run (a paired comparison: same seed, same data), their mean, its standard
    error, their median and how many are within 2%. Run-to-run spread makes the gaps of one
    label spread by several points; the standard error says how far their mean can be trusted,
    and the median how it reads when a few base runs are outliers."""
    gaps: dict[str, list[float]] = {}
    for runs in panels.values():
        base = last_mean(runs[0][1])
        for label, history in runs[1:]:
            gaps.setdefault(label, []).append(100 * (last_mean(history) / base - 1))
    rows = ["| moments / master | n | mean gap | standard error | median gap | within 2% |",
            "|---|---:|---:|---:|---:|---:|"]
    for label, values in gaps.items():
        error = statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None
        shown = "" if error is None else f"{error:.1f} points"
        within = sum(abs(g) <= 2 for g in values)
        rows.append(f"| {label} | {len(values)} | {statistics.fmean(values):+.1f}% | {shown} | "
                    f"{statistics.median(values):+.1f}% | {within} of {len(values)} |")
    return "\n".join(rows)


def mean_ratio_curves(panels: dict[str, Runs], window: int) -> dict[str, list[float]]:
    """Per label but the first of each panel: the running-mean loss over the panel's first
    run's, step by step, averaged over the panels that hold it (over the steps all have)."""
    ratios: dict[str, list[list[float]]] = {}
    for runs in panels.values():
        base = running_mean([r["loss"] for r in runs[0][1]], window)
        for label, history in runs[1:]:
            curve = running_mean([r["loss"] for r in history], window)
            ratios.setdefault(label, []).append([c / b for c, b in zip(curve, base)])
    return {label: [statistics.fmean(step) for step in zip(*curves)]
            for label, curves in ratios.items()}


def plot(panels: dict[str, Runs], out: pathlib.Path, *, window: int, columns: int,
         ratio_panel: str | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    from matplotlib.ticker import NullFormatter

    cells = len(panels) + (ratio_panel is not None)
    columns = min(columns, cells)
    lines = -(-cells // columns)
    fig, axes = plt.subplots(lines, columns, figsize=(4.2 * columns, 3.2 * lines),
                             squeeze=False)
    flat = list(axes.flat)
    low = min(min(running_mean([r["loss"] for r in h], window)) for runs in panels.values()
              for _, h in runs)
    high = max(max(running_mean([r["loss"] for r in h], window)) for runs in panels.values()
               for _, h in runs)
    colours = {}
    for ax, (panel, runs) in zip(flat, panels.items()):
        for label, history in runs:
            line, = ax.plot([r["step"] for r in history],
                            running_mean([r["loss"] for r in history], window), label=label,
                            linewidth=1, color=colours.get(label))
            colours[label] = line.get_color()
        ax.set_yscale("log")
        ax.set_yticks(TICKS, [f"{t:g}" for t in TICKS])
        ax.set_ylim(low * 0.95, high * 1.05)  # after the ticks, which would widen it
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel(f"loss ({window}-step running mean)", fontsize=8)
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3, which="both")
    flat[0].legend(fontsize=7)
    if ratio_panel is not None:
        ax = flat[len(panels)]
        for label, curve in mean_ratio_curves(panels, window).items():
            ax.plot(range(1, len(curve) + 1), curve, label=label, linewidth=1,
                    color=colours[label])
        ax.axhline(1.0, color="black", linewidth=0.8)
        for bound in (0.98, 1.02):
            ax.axhline(bound, color="grey", linewidth=0.6, linestyle="--")
        ax.set_title(ratio_panel, fontsize=10)
        ax.set_ylabel("loss / first run's", fontsize=8)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in flat[cells:]:
        ax.set_visible(False)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", nargs=3, action="append", required=True,
                   metavar=("PANEL", "LABEL", "DIR"), help="a run: panel, label, output dir")
    p.add_argument("--out", type=pathlib.Path, required=True, help="the PNG to write")
    p.add_argument("--window", type=int, default=10, help="running mean over N steps")
    p.add_argument("--columns", type=int, default=6, help="panels in a row of the figure")
    p.add_argument("--ratio-panel", metavar="TITLE",
                   help="add a panel of each label's loss over its panel's first run's, "
                        "averaged over the panels")
    args = p.parse_args(argv)
    if args.window < 1 or args.columns < 1:
        p.error("--window and --columns must be at least 1")
    panels: dict[str, Runs] = {}
    for panel, label, run_dir in args.run:
        panels.setdefault(panel, []).append((label, history_of(pathlib.Path(run_dir))))
    print(table(panels))
    print()
    print(summary(panels))
    print()
    print(paired(panels))
    plot(panels, args.out, window=args.window, columns=args.columns,
         ratio_panel=args.ratio_panel)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
