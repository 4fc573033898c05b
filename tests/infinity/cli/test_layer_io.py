"""The layer fetch / optimizer patterns of infinity-nvme-bench --mix (infinity/cli/layer_io.py)."""

import os
import sys
import types

import pytest
import torch

from aio.device_pauses import stat_path
from infinity.cli import layer_io
from infinity.cli import nvme_measure as bench

SMALL = 8 << 20  # 8 layers of 7 tensors of at least 64x64 bf16


class FakeDeepSpeedHandle:
    """DeepSpeed's aio_handle as the adapter uses it: transfers run at once, wait() counts them."""

    def __init__(self, *config):
        self.done = 0

    def new_cpu_locked_tensor(self, nbytes, example):
        return torch.empty(nbytes, dtype=example.dtype)

    def async_pread(self, buffer, path):
        with open(path, "rb") as f:
            f.readinto(buffer.numpy())
        self.done += 1
        return 0

    def async_pwrite(self, buffer, path):
        with open(path, "wb") as f:
            f.write(buffer.numpy().tobytes())
        self.done += 1
        return 0

    def wait(self):
        assert self.done > 0, "DeepSpeed asserts when wait() has nothing to wait for"
        done, self.done = self.done, 0
        return done


@pytest.fixture
def fake_deepspeed(monkeypatch):
    builder = types.SimpleNamespace(
        load=lambda verbose: types.SimpleNamespace(aio_handle=FakeDeepSpeedHandle))
    op_builder = types.ModuleType("deepspeed.ops.op_builder")
    op_builder.AsyncIOBuilder = lambda: builder
    for name, module in {"deepspeed": types.ModuleType("deepspeed"),
                         "deepspeed.ops": types.ModuleType("deepspeed.ops"),
                         "deepspeed.ops.op_builder": op_builder}.items():
        monkeypatch.setitem(sys.modules, name, module)


def test_plan_keeps_tinyllama_shapes_when_they_fit_and_scales_both_dimensions_otherwise():
    assert layer_io.plan(1 << 30) == [(2048, 2048)] * 4 + [(5632, 2048)] * 2 + [(2048, 5632)]
    small = layer_io.plan(SMALL)
    assert len(small) == 7 and all(d % 64 == 0 for shape in small for d in shape)
    assert sum(h * w * 2 for h, w in small) * layer_io.LAYERS <= SMALL
    with pytest.raises(ValueError, match="cannot hold"):
        layer_io.plan(256 << 10)


def test_every_tool_runs_both_patterns_every_round_and_moves_what_it_should(tmp_path,
                                                                            fake_deepspeed):
    runs, info = layer_io.measure(bench.EngineConfig(queue_depth=4), str(tmp_path), SMALL, 2)
    assert info["tools"][1:] == [f"{info['tools'][0]} 4K pages", "deepspeed"]
    assert info["deepspeed_skipped"] is None
    assert set(info["extents"]) == {info["tools"][0], "deepspeed"}  # the 4K-pages tool writes none
    for counts in info["extents"].values():
        assert counts is None or (len(counts) == layer_io.LAYERS * 7 and min(counts) >= 1)
    layer = sum(h * w * 2 for h, w in map(tuple, info["shapes"]))
    assert len(runs) == 2 * 3 * 2
    for run in runs:
        assert run.read_nbytes == layer_io.LAYERS * layer
        assert run.write_nbytes == (run.read_nbytes if run.pattern == "optimizer" else 0)
        assert run.seconds > 0
        # the disk's own counters (aio.device_pauses.read_sample), where it has them
        if stat_path(str(tmp_path)) is None:
            assert run.device_requests is None and run.device_nbytes is None
        elif not run.tool.startswith("deepspeed"):  # ours reads with O_DIRECT: the disk moved
            assert run.device_requests > 0 and run.device_nbytes >= run.read_nbytes
    firsts = [run.tool for run in runs[::2]]
    assert firsts[:3] == info["tools"] and firsts[3:] == info["tools"][::-1]  # alternating rounds


def test_without_deepspeed_the_column_is_skipped_with_the_reason(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import fails
    runs, info = layer_io.measure(bench.EngineConfig(queue_depth=4), str(tmp_path), SMALL, 1,
                                  with_deepspeed=True)
    assert ("ModuleNotFoundError" in info["deepspeed_skipped"]
            or "ImportError" in info["deepspeed_skipped"])
    assert {run.tool for run in runs} == set(info["tools"]) and len(info["tools"]) == 2


def test_a_file_changed_behind_the_tool_is_reported_by_name(tmp_path, monkeypatch):
    ours = layer_io.OursTool(bench.EngineConfig(queue_depth=4))
    try:
        files = layer_io.LayerFiles(ours, str(tmp_path), layer_io.plan(SMALL))
        victim = files.paths[3][5]
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) - 1)
            f.write(b"\0")
        with pytest.raises(OSError, match=os.path.basename(victim)):
            layer_io.fetch(files)
    finally:
        ours.close()


def test_a_short_file_fails_the_run(tmp_path):
    ours = layer_io.OursTool(bench.EngineConfig(queue_depth=4))
    try:
        files = layer_io.LayerFiles(ours, str(tmp_path), layer_io.plan(SMALL))
        os.truncate(files.paths[0][0], 4096)
        with pytest.raises(OSError, match="end of file"):
            layer_io.optimizer(files)
    finally:
        ours.close()
