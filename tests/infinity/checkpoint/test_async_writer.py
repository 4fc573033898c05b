"""Background checkpoint saves: snapshots at add(), a bounded host budget, errors handed back."""

import threading

import pytest
import torch

from infinity.checkpoint import CheckpointReader, latest_tag
from infinity.checkpoint.async_writer import AsyncCheckpointWriter
from infinity.errors import CheckpointError


def test_a_background_save_commits_snapshots_taken_at_add(tmp_path):
    weights = {f"w{i}": torch.randn(3000) for i in range(6)}
    saver = AsyncCheckpointWriter(tmp_path, "step1", budget_nbytes=16 << 10, chunk_nbytes=4096,
                                  metadata={"step": 1})
    for name, tensor in weights.items():
        saver.add(name, tensor)
    expected = {k: v.clone() for k, v in weights.items()}
    for tensor in weights.values():
        tensor.zero_()  # training goes on: the save keeps the values of add() time
    saver.metadata["note"] = "set before commit"
    assert saver.commit().result(timeout=60) == tmp_path / "step1"
    reader = CheckpointReader(tmp_path)
    assert latest_tag(tmp_path) == "step1" and reader.metadata == {"step": 1,
                                                                   "note": "set before commit"}
    for name, tensor in expected.items():
        assert torch.equal(reader.read(name), tensor)
    assert 0 < saver.peak_queued_nbytes <= 16 << 10


def test_add_blocks_while_the_budget_is_full(tmp_path, monkeypatch):
    """The worker is held inside its first write: add() must stop once the budget is queued."""
    gate = threading.Event()
    from infinity.checkpoint import writer as writer_module
    real_write = writer_module.TensorSink.write

    def held_write(self, piece):
        gate.wait(timeout=30)
        real_write(self, piece)

    monkeypatch.setattr(writer_module.TensorSink, "write", held_write)
    saver = AsyncCheckpointWriter(tmp_path, "step1", budget_nbytes=4000)
    waiting = threading.Event()

    class SpiedCondition(threading.Condition):  # says when add() waits for room
        def wait(self, timeout=None):
            waiting.set()
            return super().wait(timeout)

    saver._room = SpiedCondition()  # the worker has not used it yet: nothing was added
    big = torch.arange(10_000, dtype=torch.float32)  # 40 KB: ten budget-sized pieces
    adder = threading.Thread(target=saver.add, args=("big", big))
    adder.start()
    assert waiting.wait(timeout=60), "add() never waited for room"
    assert adder.is_alive(), "add() returned with 40 KB queued against a 4 KB budget"
    assert saver.peak_queued_nbytes == 4000  # one piece queued, held in the worker's write
    gate.set()
    adder.join(timeout=30)
    saver.commit().result(timeout=60)
    assert torch.equal(CheckpointReader(tmp_path).read("big"), big)


def test_an_error_on_the_worker_reaches_the_caller_and_leaves_nothing(tmp_path):
    saver = AsyncCheckpointWriter(tmp_path, "step1", budget_nbytes=1 << 20,
                                  metadata={"bad": object()})
    saver.add("w", torch.ones(4))
    with pytest.raises(CheckpointError, match="metadata must be JSON"):
        saver.commit().result(timeout=60)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match="metadata must be JSON"):  # raised again, not lost
        saver.add("x", torch.ones(1))


def test_a_committed_save_takes_no_more_tensors(tmp_path):
    saver = AsyncCheckpointWriter(tmp_path, "step1", budget_nbytes=1 << 20)
    saver.commit().result(timeout=60)
    with pytest.raises(CheckpointError, match="already committed"):
        saver.add("x", torch.ones(1))


def test_a_failed_add_is_raised_by_the_next_call(tmp_path):
    saver = AsyncCheckpointWriter(tmp_path, "step1", budget_nbytes=1 << 20)
    saver.add("w", torch.ones(4))
    saver.add("w", torch.ones(4))  # a duplicate name fails on the worker
    future = saver.commit()
    with pytest.raises(CheckpointError, match="already in checkpoint"):
        future.result(timeout=60)
    assert list(tmp_path.iterdir()) == []


def test_abort_drops_the_save(tmp_path):
    saver = AsyncCheckpointWriter(tmp_path, "step1", budget_nbytes=1 << 20)
    saver.add("w", torch.ones(4))
    saver.abort()
    assert list(tmp_path.iterdir()) == [] and latest_tag(tmp_path) is None
