"""Ranks without a process group: shard bounds, and one process's collectives are identities
(the multi-process behaviour is in tests/infinity/test_engine_ranks.py)."""

import os

import pytest
import torch
from children import python_child

from infinity.zero import Partition, Ranks, Shard


@pytest.mark.parametrize("numel, world", [(148, 2), (55, 2), (5, 4), (1, 2), (1000, 3), (7, 1)])
def test_shards_cover_the_unit_once_with_equal_padded_sizes(numel, world):
    shards = [Ranks(rank, world).shard(numel) for rank in range(world)]
    assert {s.numel for s in shards} == {-(-numel // world)}
    covered = [i for s in shards for i in range(s.start, s.stop)]
    assert covered == list(range(numel))  # in rank order, no gap, no overlap
    per = -(-numel // world)
    real = [max(0, min(per, numel - r * per)) for r in range(world)]  # the last ones padded
    assert [s.real_numel for s in shards] == real


def test_a_shard_may_be_all_padding():
    assert Ranks(3, 4).shard(2) == Shard(2, 2, 1)
    assert Ranks(3, 4).shard(2).real_numel == 0


def test_one_process_collectives_are_identities():
    ranks = Ranks.single()
    t = torch.arange(5.0)
    ranks.all_reduce_mean_(t, "x")
    ranks.broadcast_(t, "x")
    assert torch.equal(t, torch.arange(5.0))
    assert ranks.reduce_scatter_mean(t, "x") is t
    assert torch.equal(ranks.all_gather(t, 3, "x"), t[:3])
    assert ranks.all_reduce_sum(2.5, "x") == 2.5
    ranks.check_same("anything", "x")
    assert not ranks.failed


def test_one_rank_partitions_nothing_whatever_the_stage():
    for stage in range(4):
        one = Partition(Ranks.single(), stage)
        assert not (one.state or one.grads or one.params)
    two = [Partition(Ranks(0, 2), stage) for stage in range(4)]
    assert [(p.state, p.grads, p.params) for p in two] == [
        (False, False, False), (True, False, False), (True, True, False), (True, True, True)]


def test_from_environment_without_torchrun_is_one_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ranks = Ranks.from_environment(timeout_s=5)
    assert (ranks.rank, ranks.world) == (0, 1)


def test_a_partial_torchrun_environment_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for key in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(ValueError,
                       match="WORLD_SIZE is 2 but RANK, MASTER_ADDR, MASTER_PORT is not set"):
        Ranks.from_environment(timeout_s=5)


def test_a_rendezvous_the_other_ranks_never_join_fails_in_time(monkeypatch):
    """Rank 0 of 2 alone: the process group cannot start; RankError after the timeout, which
    init_process_group is given."""
    import datetime
    import socket

    import torch.distributed as dist

    from infinity.errors import RankError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    timeouts, init_process_group = [], dist.init_process_group

    def spy(*args, timeout=None, **kwargs):
        timeouts.append(timeout)
        return init_process_group(*args, timeout=timeout, **kwargs)

    monkeypatch.setattr(dist, "init_process_group", spy)
    with pytest.raises(RankError, match="rank 0 of 2: init_process_group .* failed within 2 s"):
        Ranks.from_environment(timeout_s=2)
    assert timeouts == [datetime.timedelta(seconds=2)]


# The group the engine runs on ends at a normal exit. The child's own hook, registered first,
# runs after the engine's (atexit runs hooks last in, first out) and tells whether the group
# was still there.
_EXIT_CHILD = """
import atexit, sys
import torch.distributed as dist
atexit.register(lambda: print("group at exit:", dist.is_initialized()))
starter, end = sys.argv[1:3]
if starter == "deepspeed":
    import infinity.deepspeed
    infinity.deepspeed.init_distributed()
else:  # the application's group, which the engine (Ranks.from_environment) joins
    from infinity.zero import Ranks
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    Ranks.from_environment(timeout_s=30.0)
assert dist.is_initialized()
if end == "raise":
    raise RuntimeError("the script failed")
if end == "exit":
    sys.exit(3)
if end == "destroy":  # the application ended it: nothing left to do
    dist.destroy_process_group()
"""


@pytest.mark.parametrize("starter, end, code, alive", [
    ("engine", "return", 0, False), ("engine", "exit", 3, False), ("engine", "raise", 1, True),
    ("engine", "destroy", 0, False), ("deepspeed", "return", 0, False),
    ("deepspeed", "raise", 1, True)])
def test_the_group_is_destroyed_at_a_normal_exit(starter, end, code, alive):
    """torch's gloo group left to the interpreter's teardown often aborted a finished torchrun
    rank (SIGABRT). After an unhandled exception it stays: destroying it waits for a collective
    the exception may have left in flight."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}  # one process
    out = python_child(["-c", _EXIT_CHILD, starter, end], env=env, timeout=120)
    assert out.returncode == code, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == f"group at exit: {alive}", out.stdout + out.stderr
