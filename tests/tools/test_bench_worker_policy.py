"""tools.bench_worker_policy: a tiny GPT's steps alternate the worker's policy, ABBA."""

import os
import re
import sys
import threading

import pytest

from tools import bench_worker_policy

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="per-thread policies are Linux's")

TINY = ["--layers", "1", "--d-model", "64", "--vocab", "128", "--seq", "8"]


def test_steps_alternate_and_each_side_is_reported(tmp_path, capsys, monkeypatch):
    # another engine's worker in the same process (a test's left open) is not the one set
    other_done = threading.Event()
    other = threading.Thread(target=other_done.wait, name="infinity-optim_0")
    other.start()
    seen = []
    real = bench_worker_policy.set_policy
    monkeypatch.setattr(bench_worker_policy, "set_policy",
                        lambda tid, name: (seen.append((tid, name)), real(tid, name)))
    try:
        assert bench_worker_policy.main(["--policy", "batch", "--block", "1", "--path",
                                         str(tmp_path), "--steps", "10", *TINY]) == 0
    finally:
        other_done.set()
        other.join()
    out = capsys.readouterr().out
    assert re.search(r"SCHED_BATCH: steps=4 ", out) and re.search(r"SCHED_OTHER: steps=4 ", out)
    assert re.search(r"faster in \d of 4 pairs", out)
    # steps 1..9 (warm-up 2): step 1 and the timed steps 2..9 in ABBA order, then restored
    assert len({tid for tid, _ in seen}) == 1 and seen[0][0] != other.native_id
    abba = ["SCHED_OTHER", "SCHED_BATCH", "SCHED_BATCH", "SCHED_OTHER"]
    assert [name for _, name in seen[1:]] == abba + abba + ["SCHED_OTHER"]
    assert os.listdir(tmp_path) == []


def test_a_policy_that_does_not_take_is_refused(monkeypatch):
    monkeypatch.setattr(os, "sched_setscheduler", lambda *a: None)
    with pytest.raises(SystemExit, match="not under SCHED_IDLE"):
        bench_worker_policy.set_policy(os.getpid(), "SCHED_IDLE")


def test_a_policy_the_process_may_not_leave_is_named(monkeypatch):
    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(os, "sched_setscheduler", refuse)
    with pytest.raises(SystemExit, match="needs CAP_SYS_NICE"):
        bench_worker_policy.set_policy(os.getpid(), "SCHED_OTHER")


def test_an_unusable_path_is_refused_in_one_line(tmp_path, capsys):
    assert bench_worker_policy.main(["--policy", "batch", "--path",
                                     str(tmp_path / "missing" / "dir"), *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot use --path ") and "\n" not in err


def test_a_run_that_fails_midway_closes_its_engine_and_removes_its_files(tmp_path, monkeypatch):
    real, calls = bench_worker_policy.set_policy, []

    def fails_at_the_third(tid, name):
        calls.append(tid)
        if len(calls) == 3:
            raise SystemExit("error: refused")
        real(tid, name)
    monkeypatch.setattr(bench_worker_policy, "set_policy", fails_at_the_third)
    with pytest.raises(SystemExit, match="refused"):
        bench_worker_policy.main(["--policy", "batch", "--path", str(tmp_path), "--steps", "8",
                                  *TINY])
    # the engine was closed: its worker thread has ended
    assert calls[0] not in {t.native_id for t in threading.enumerate() if t.is_alive()}
    assert os.listdir(tmp_path) == []


def test_one_torch_thread_alternates_with_the_default_count_and_is_restored(tmp_path, capsys,
                                                                             monkeypatch):
    import torch
    before = torch.get_num_threads()
    seen = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n)))
    try:
        assert bench_worker_policy.main(["--policy", "torch-1", "--block", "1", "--path",
                                         str(tmp_path), "--steps", "10", *TINY]) == 0
    finally:
        real(before)
    out = capsys.readouterr().out
    assert re.search(rf"1 torch thread: steps=4 .*\n.*{before} torch threads: steps=4 ", out)
    abba = [before, 1, 1, before]
    # step 1, the timed steps 2..9 in ABBA order, then the default count restored
    assert seen == [before] + abba + abba + [before]


def test_blocks_alternate_and_the_first_step_of_each_is_not_timed(tmp_path, capsys, monkeypatch):
    """What a block's first step inherits from the block before (the step's tail) is not
    charged to its side: blocks of 2, so one timed step a block."""
    seen = []
    real = bench_worker_policy.set_policy
    monkeypatch.setattr(bench_worker_policy, "set_policy",
                        lambda tid, name: (seen.append(name), real(tid, name)))
    assert bench_worker_policy.main(["--policy", "batch", "--block", "2", "--path", str(tmp_path),
                                     "--steps", "10", *TINY]) == 0
    out = capsys.readouterr().out
    assert re.search(r"SCHED_BATCH: steps=2 ", out) and re.search(r"SCHED_OTHER: steps=2 ", out)
    other, batch = "SCHED_OTHER", "SCHED_BATCH"
    # step 1, then 4 blocks of 2 (B A A B), then restored
    assert seen == [other] + [other] * 2 + [batch] * 4 + [other] * 2 + [other]


def test_a_block_of_no_steps_or_too_few_steps_for_a_block_a_side_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench_worker_policy.main(["--policy", "batch", "--block", "0", "--path", str(tmp_path),
                                  *TINY])
    # 5 timed steps after 2 warm-up: block 0 (4 steps) is the other side's, and the first
    # step of block 1 is not timed, so the trial side would have none
    with pytest.raises(SystemExit):
        bench_worker_policy.main(["--policy", "batch", "--block", "4", "--steps", "7", "--path",
                                  str(tmp_path), *TINY])
    assert "times no step of the trial side in blocks of 4: at least 6" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []  # refused before anything was built


@pytest.mark.parametrize("extra, steps", [([], 2 + 8 * 3), (["--warmup", "3"], 3 + 8 * 3),
                                          (["--steps", "9"], 9), (["--steps=9"], 9)])
def test_steps_default_to_eight_blocks_after_the_warm_up(tmp_path, capsys, monkeypatch, extra,
                                                         steps):
    asked = []

    def fake_run(args, trial, directory, blocks):
        asked.append((args.steps, blocks))
        return {trial: [1.0], "other": [1.0]}

    monkeypatch.setattr(bench_worker_policy, "run", fake_run)
    assert bench_worker_policy.main(["--policy", "batch", "--block", "3", "--path", str(tmp_path),
                                     *extra, *TINY]) == 0
    assert asked == [(steps, 3)]
