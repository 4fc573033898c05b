"""tools/bench_busy.py: the spinners come and go with the busy half, rounds alternate quiet and
busy, and the ratios are the medians' (the workloads themselves are the engine's and
bench_step's, tested elsewhere; here they are stand-ins so the test costs no training)."""

import json
import os

import pytest

from tools import bench_busy


def _children() -> set[int]:
    """This process's live child pids (from /proc)."""
    me, pids = str(os.getpid()), set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me and fields[0] != "Z":
                pids.add(int(entry))
    return pids


def test_busy_runs_one_spinner_a_process_and_kills_them_all():
    before = _children()
    with bench_busy.busy(3):
        spinning = _children() - before
        assert len(spinning) == 3
    assert not (_children() & spinning)


def test_rounds_alternate_and_report_the_medians_ratios(tmp_path, monkeypatch):
    calls, before = [], _children()  # a session fixture may hold a child of its own

    def fake_round(scratch, steps):
        spinning = bool(_children() - before)
        calls.append(spinning)
        return {"default": 2.0 if spinning else 1.0, "default-torch": 1.5 if spinning else 0.5}

    monkeypatch.setattr(bench_busy, "default_round", fake_round)
    out = tmp_path / "busy.json"
    assert bench_busy.main(["--path", str(tmp_path), "--workloads", "default", "--rounds", "2",
                            "--busy", "1", "--json", str(out)]) == 0
    assert calls == [False, True, True, False]  # quiet first in odd rounds, busy first in even
    results = json.loads(out.read_text())
    assert results["default"] == {"quiet_s": 1.0, "busy_s": 2.0, "busy_over_quiet": 2.0,
                                  "rounds": [2.0, 2.0], "over_torch_quiet": 2.0,
                                  "over_torch_busy": 2.0 / 1.5}
    assert results["default-torch"]["busy_over_quiet"] == 3.0
    assert os.listdir(tmp_path) == ["busy.json"]  # the scratch folder is gone


def test_a_failed_round_is_one_line_and_leaves_no_spinner_or_scratch(tmp_path, monkeypatch,
                                                                      capsys):
    before = _children()

    def failing_round(scratch, steps):
        if _children() - before:  # in the busy half
            raise RuntimeError("python -m infinity.cli.train failed:\nboom")
        return {"default": 1.0, "default-torch": 1.0}

    monkeypatch.setattr(bench_busy, "default_round", failing_round)
    assert bench_busy.main(["--path", str(tmp_path), "--workloads", "default", "--rounds", "1",
                            "--busy", "2"]) == 1
    assert "error: python -m infinity.cli.train failed" in capsys.readouterr().err
    assert not (_children() - before)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("args", [["--workloads", "nope"], ["--rounds", "0"], ["--busy", "0"]])
def test_bad_arguments_are_refused(tmp_path, args):
    with pytest.raises(SystemExit):
        bench_busy.main(["--path", str(tmp_path), *args])


def test_an_unusable_path_is_one_line(tmp_path, capsys):
    assert bench_busy.main(["--path", str(tmp_path / "missing" / "deeper")]) == 2
    assert "cannot use --path" in capsys.readouterr().err
