"""UpcastBuffers: wider copies into kept buffers, never one a view still uses, within capacity."""

import torch

from infinity.zero.upcasts import UpcastBuffers, sole_owner

MIB = 1 << 20


def bf16(n, seed=0):
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).bfloat16()


def test_a_copy_is_exact_and_goes_into_the_buffer_given_back():
    buffers = UpcastBuffers(capacity=MIB)
    a, b = bf16(1000, 1), bf16(1000, 2)
    first = buffers.copy(a, torch.float32)
    assert torch.equal(first, a.float()) and buffers.lent_bytes == 4000
    where = first.data_ptr()
    buffers.give_back(first)
    del first
    assert (buffers.lent_bytes, buffers.kept_bytes) == (0, 4000)
    second = buffers.copy(b, torch.float32)
    assert second.data_ptr() == where and torch.equal(second, b.float())
    assert (buffers.fresh, buffers.reused, buffers.kept_bytes) == (1, 1, 0)


def test_only_a_buffer_of_the_same_size_and_dtype_is_used_again():
    buffers = UpcastBuffers(capacity=MIB)
    buffers.give_back(buffers.copy(bf16(1000), torch.float32))
    assert buffers.copy(bf16(999), torch.float32).numel() == 999
    assert buffers.copy(bf16(1000), torch.float64).dtype == torch.float64
    assert (buffers.fresh, buffers.reused, buffers.kept_bytes) == (3, 0, 4000)


def test_a_buffer_a_view_outlived_is_not_kept():
    buffers = UpcastBuffers(capacity=MIB)
    copy = buffers.copy(bf16(1000, 1), torch.float32)
    view = copy[10:20]
    before = view.clone()
    assert not sole_owner(copy)
    buffers.give_back(copy)
    assert buffers.kept_bytes == 0
    buffers.copy(bf16(1000, 2), torch.float32)
    assert torch.equal(view, before) and buffers.reused == 0


def test_lent_and_kept_stay_within_capacity_dropping_the_oldest_kept():
    buffers = UpcastBuffers(capacity=10_000)  # two copies of 1000 fp32 elements and a bit
    copies = [buffers.copy(bf16(1000 + i), torch.float32) for i in range(3)]  # 12 KB lent
    for c in copies:
        buffers.give_back(c)
        assert buffers.lent_bytes + buffers.kept_bytes <= 10_000
    assert buffers.kept_bytes == 4004 + 4008  # the oldest (1000 elements) was dropped
    big = buffers.copy(bf16(2000), torch.float32)  # 8 KB coming: the older kept one goes
    assert buffers.kept_bytes == 0 and buffers.lent_bytes == 8000 and big.numel() == 2000
