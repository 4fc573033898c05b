"""tools.plot_optimizer_state: the table's figures from metrics.jsonl, the PNG, and one clear
line for a run without step records."""

import json

import pytest

from tools import plot_optimizer_state


def _run(path, losses, moved_per_step):
    path.mkdir()
    with (path / "metrics.jsonl").open("w") as f:
        for step, loss in enumerate(losses, 1):
            f.write(json.dumps({"step": step, "loss": loss, "step_s": 0.5,
                                "tier_used_bytes": {"nvme": 3_000_000},
                                "moved_bytes": {"host->nvme": step * moved_per_step,
                                                "nvme->host": 0}}) + "\n")
    return path


def test_table_and_plot(tmp_path, capsys):
    base = _run(tmp_path / "a", [2.0] * 280 + [1.0] * 20, 4_000_000)
    other = _run(tmp_path / "b", [2.0] * 280 + [1.05] * 20, 1_000_000)
    out = tmp_path / "img" / "loss.png"
    assert plot_optimizer_state.main(["--out", str(out), "--run", "seed 0", "fp32", str(base),
                                      "--run", "seed 0", "int8", str(other)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert rows[2] == "| seed 0 | fp32 | 1.0000 |  | 2.000 / 2.000 / 1.000 | 3.00 MB | 4.00 MB " \
                      "| 0.50 s |"
    assert rows[3].startswith("| seed 0 | int8 | 1.0500 | +5.0% |")
    assert "| 1.00 MB |" in rows[3]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_records_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no step records in .*empty/metrics.jsonl"):
        plot_optimizer_state.main(["--out", str(tmp_path / "x.png"),
                                   "--run", "p", "l", str(tmp_path / "empty")])


def test_summary_over_seeds_and_ratio_panel(tmp_path, capsys):
    """Each label's per-seed gap, and its mean over the seeds that hold it against the first
    label's mean over the same seeds (seed 1 has no int8 run: int8's mean is seed 0's only)."""
    runs = ["--run", "seed 0", "fp32", str(_run(tmp_path / "a0", [2.0] * 80 + [1.0] * 20, 1)),
            "--run", "seed 0", "int8", str(_run(tmp_path / "b0", [2.0] * 80 + [1.1] * 20, 1)),
            "--run", "seed 0", "none", str(_run(tmp_path / "c0", [2.0] * 80 + [1.2] * 20, 1)),
            "--run", "seed 1", "fp32", str(_run(tmp_path / "a1", [2.0] * 80 + [3.0] * 20, 1)),
            "--run", "seed 1", "none", str(_run(tmp_path / "c1", [2.0] * 80 + [2.7] * 20, 1))]
    out = tmp_path / "loss.png"
    assert plot_optimizer_state.main(["--out", str(out), "--columns", "2", "--ratio-panel",
                                      "mean over seeds", *runs]) == 0
    text = capsys.readouterr().out
    summary = text.split("\n\n")[1].splitlines()
    assert summary[0] == "| moments / master | seed 0 | seed 1 | mean last-20 | vs first | n |"
    assert summary[2] == "| fp32 | 1.0000 | 3.0000 | 2.0000 |  | 2 |"
    assert summary[3] == "| int8 | +10.0% |  | 1.1000 | +10.0% | 1 |"
    assert summary[4] == "| none | +20.0% | -10.0% | 1.9500 | -2.5% | 2 |"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_mean_ratio_curves_average_over_panels():
    def records(losses):
        return [{"step": i + 1, "loss": x} for i, x in enumerate(losses)]
    panels = {"s0": [("fp32", records([1.0, 2.0])), ("int8", records([1.5, 2.0]))],
              "s1": [("fp32", records([2.0, 2.0])), ("int8", records([2.0, 1.0]))]}
    curves = plot_optimizer_state.mean_ratio_curves(panels, window=1)
    assert curves == {"int8": [pytest.approx(1.25), pytest.approx(0.75)]}


@pytest.mark.parametrize("option", ["--window", "--columns"])
def test_a_window_or_columns_below_one_is_refused(tmp_path, option, capsys):
    run = _run(tmp_path / "a", [1.0] * 30, 1)
    with pytest.raises(SystemExit) as exc:
        plot_optimizer_state.main(["--out", str(tmp_path / "x.png"), option, "0",
                                   "--run", "p", "l", str(run)])
    assert exc.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_paired_gaps_mean_standard_error_and_median(tmp_path, capsys):
    """The third table: per label, the gaps against each seed's first run (+10%, -10%, +1%):
    mean +0.3%, standard error stdev / sqrt(3) = 5.8 points, median +1.0%, one within 2%; a
    label with one seed has no standard error."""
    runs = []
    for seed, (base, int8) in enumerate([(1.0, 1.1), (2.0, 1.8), (1.0, 1.01)]):
        runs += ["--run", f"seed {seed}", "fp32",
                 str(_run(tmp_path / f"a{seed}", [2.0] * 80 + [base] * 20, 1)),
                 "--run", f"seed {seed}", "int8",
                 str(_run(tmp_path / f"b{seed}", [2.0] * 80 + [int8] * 20, 1))]
    runs += ["--run", "seed 0", "none", str(_run(tmp_path / "c0", [2.0] * 80 + [1.2] * 20, 1))]
    assert plot_optimizer_state.main(["--out", str(tmp_path / "loss.png"), *runs]) == 0
    table = capsys.readouterr().out.split("\n\n")[2].splitlines()
    assert table[0] == ("| moments / master | n | mean gap | standard error | median gap | "
                        "within 2% |")
    assert table[2] == "| int8 | 3 | +0.3% | 5.8 points | +1.0% | 1 of 3 |"
    assert table[3] == "| none | 1 | +20.0% |  | +20.0% | 0 of 1 |"
