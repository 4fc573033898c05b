"""CUDA paths: device arenas (bounce and piecewise moves), pinned host arenas and pools."""

import copy

import pytest
import torch
from torch import nn

from infinity.memory import Arena, BufferPool

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


def test_device_params_rebound_after_compaction_still_train():
    torch.manual_seed(0)
    model = nn.Linear(64, 32).cuda()
    reference = copy.deepcopy(model)
    arena = Arena(1 << 20, device="cuda")
    filler = arena.alloc(4096, torch.uint8)
    blocks = []
    for param in model.parameters():
        block = arena.alloc(param.shape, param.dtype)
        block.tensor.copy_(param.detach())
        arena.bind(block, param)
        blocks.append(block)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    inputs = torch.randn(8, 64, device="cuda")
    for step in range(4):
        if step == 2:
            arena.free(filler)
            arena.alloc(arena.stats().largest_hole_nbytes + 256, torch.uint8)
            assert arena.stats().compactions == 1
        for net, optimizer in ((model, opt), (reference, ref_opt)):
            optimizer.zero_grad()
            net(inputs).square().mean().backward()
            optimizer.step()
    for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(param.detach(), ref.detach())


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


def test_pinned_pool_stages_a_device_tensor_larger_than_a_buffer():
    pool = BufferPool(2, 1 << 16, pinned=True)
    assert pool.pinned
    src = torch.randn(10 * (1 << 14) + 3, device="cuda")
    out = torch.empty(src.numel() * 4, dtype=torch.uint8)

    def sink(chunk: torch.Tensor, offset: int) -> None:
        out[offset : offset + chunk.numel()].copy_(chunk)

    pool.copy_out(src, sink)
    assert torch.equal(out.view(torch.float32), src.cpu())
    pool.close()
