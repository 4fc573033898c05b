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
