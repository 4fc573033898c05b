"""CUDA paths: device arenas (bounce and piecewise moves) and pinned host arenas."""


import pytest
import torch

from infinity.memory import Arena

pytestmark = pytest.mark.requires_cuda


@pytest.mark.parametrize("gap", [256, 64 * 1024, (1 << 20) + 256, 3 << 20])
def test_device_arena_compaction_keeps_contents(gap):
    block_nbytes, tail = 9 << 20, 4096  # larger than the 4 MiB bounce scratch
    arena = Arena(gap + block_nbytes + tail, device="cuda")
    assert arena.pinned is False
    hole = arena.alloc(gap, torch.uint8)
    moving = arena.alloc(block_nbytes // 4, torch.float32)
    assert moving.tensor.is_cuda
    assert moving.tensor.data_ptr() % arena.alignment == 0
    pattern = torch.randn(block_nbytes // 4, device="cuda")
    moving.tensor.copy_(pattern)
    arena.free(hole)
    arena.alloc(gap + tail, torch.uint8)
    assert arena.stats().compactions == 1
    assert moving.offset == 0
    assert torch.equal(moving.tensor, pattern)
    arena.close()


def test_pinned_host_arena_supports_async_copies():
    arena = Arena(1 << 20, device="cpu", pinned=True)
    assert arena.pinned
    block = arena.alloc(1000, torch.float32)
    block.tensor.copy_(torch.arange(1000, dtype=torch.float32))
    on_device = block.tensor.to("cuda", non_blocking=True)
    torch.cuda.current_stream().synchronize()
    assert torch.equal(on_device.cpu(), torch.arange(1000, dtype=torch.float32))
    arena.close()
    assert not arena.pinned
