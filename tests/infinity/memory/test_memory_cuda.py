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


def test_device_arena_compaction_around_a_kept_block():
    """Blocks slide past a kept one (bounce moves for small gaps); the kept view stays valid."""
    arena = Arena(16 << 20, device="cuda", alignment=1 << 20)
    blocks = [arena.alloc(((1 << 20) - 256) // 4, torch.float32) for _ in range(12)]
    for i, block in enumerate(blocks):
        block.tensor.fill_(float(i))
    kept = blocks[4]
    view = kept.tensor
    for i in (0, 2, 3, 6):
        arena.free(blocks[i])
    arena.compact(keep=[kept])
    assert kept.tensor.data_ptr() == view.data_ptr()
    assert [blocks[i].offset >> 20 for i in (1, 5, 7, 8)] == [0, 1, 2, 3]  # 5 and 7 jump below 4
    for i in (1, 4, 5, 7, 8, 9, 10, 11):
        assert bool((blocks[i].tensor == float(i)).all()), i
    arena.close()
