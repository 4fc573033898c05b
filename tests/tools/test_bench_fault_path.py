"""tools/bench_fault_path.py: children import the checkout they are given, the table's ratios."""

import json

import pytest
from children import ROOT

from tools import bench_fault_path

TINY = ["--size", "1M", "--request-size", "256K", "--block-size", "64K", "--threads", "1",
        "--passes", "1"]


def test_two_rounds_of_this_checkout_against_itself(tmp_path, capsys):
    out = tmp_path / "out.json"
    assert bench_fault_path.main(["--before", str(ROOT), "--after", str(ROOT), "--path",
                                  str(tmp_path), *TINY, "--rounds", "2",
                                  "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "load average" in table
    rows = [line for line in table.splitlines() if line.strip().startswith("64K")]
    assert len(rows) == 4  # off and armed, read and write
    rounds = json.loads(out.read_text())["rounds"]
    assert len(rounds) == 2
    for figures in rounds:
        for key in ("65536/1/off/read", "65536/1/armed/write"):
            assert figures["before"][key]["wall_ns"] > 0 and figures["after"][key]["cpu_ns"] >= 0
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # its file is removed


def test_a_checkout_without_its_native_library_is_refused(tmp_path, capsys):
    (tmp_path / "aio").mkdir()
    with pytest.raises(SystemExit):
        bench_fault_path.main(["--before", str(tmp_path), "--path", str(tmp_path), *TINY])
    assert "build_ext --inplace" in capsys.readouterr().err


def test_a_failing_child_names_its_checkout(tmp_path):
    (tmp_path / "aio").mkdir()
    (tmp_path / "aio" / "__init__.py").write_text("raise ImportError('no engine here')\n")
    with pytest.raises(RuntimeError, match="no engine here"):
        bench_fault_path.run_child(str(tmp_path), {})


def test_report_ratios_are_after_over_before_per_round():
    def fig(wall, cpu):
        return {"4096/1/off/read": {"wall_ns": wall, "cpu_ns": cpu}}
    rounds = [{"before": fig(100, 50), "after": fig(90, 50)},
              {"before": fig(200, 40), "after": fig(220, 60)},
              {"before": fig(100, 40), "after": fig(100, 40)}]
    header, row = bench_fault_path.report(rounds, ("before", "after"))
    assert "after/before" in header
    # wall ratios 0.9, 1.1, 1.0 -> median 1.000; CPU 1.0, 1.5, 1.0 -> median 1.000 (1.00-1.50)
    assert "1.000 (0.90-1.10)" in row and "1.000 (1.00-1.50)" in row
    assert row.split("|")[0].split() == ["4K", "1", "off", "read"]
