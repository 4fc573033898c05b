"""aio.Handle at its limits: argument ranges, file offsets past 4 GiB, a buffer past 2 GiB.

Files past 4 GiB are sparse: only the bytes written take disk space.
"""

import os
import random

import numpy as np
import pytest
import torch

import aio

GiB = 1 << 30
BIG_NBYTES = (1 << 31) + 4096  # one page past 2 GiB: any int32 byte count overflows


@pytest.mark.parametrize(("option", "value"), [
    ("queue_depth", 0), ("queue_depth", -1), ("queue_depth", 4097),
    ("threads", 0), ("threads", -1), ("threads", 65),
    ("block_size", 0), ("block_size", 4095), ("block_size", (1 << 30) + 4096),
])
def test_out_of_range_options_are_refused_naming_the_option(option, value):
    with pytest.raises(ValueError, match=rf"{option} must be .* got {value}"):
        aio.Handle(**{option: value})


@pytest.mark.parametrize(("option", "value"), [
    ("queue_depth", 8.0), ("queue_depth", "8"), ("threads", True), ("threads", 1.5),
    ("block_size", None),
])
def test_options_that_are_not_ints_are_refused_naming_the_option(option, value):
    with pytest.raises(TypeError, match=f"{option} must be an int, got {value!r}"):
        aio.Handle(**{option: value})


def test_the_limits_themselves_are_accepted(tmp_path):
    data = torch.arange(300_000, dtype=torch.int32)
    out = torch.empty_like(data)
    with aio.Handle(block_size=4096, queue_depth=1, threads=64, backend="threads") as h:
        h.write(data, tmp_path / "x").wait()
        h.read(out, tmp_path / "x").wait()
    assert torch.equal(out, data)
    auto = aio.available_backends()[0]
    if auto != "threads":  # the threads backend would start 4096 workers
        with aio.Handle(queue_depth=4096, backend=auto) as h:
            out.zero_()
            h.read(out, tmp_path / "x").wait()
        assert torch.equal(out, data)


def test_offsets_past_4_gib_land_where_asked(handle, tmp_path):
    """Aligned and unaligned transfers at 5 GiB: checked against os.pread, so an offset cut to
    32 bits on both the write and the read side would still be caught."""
    path = tmp_path / "sparse"
    rng = np.random.default_rng(5)
    cases = [(5 * GiB, 1 << 20), (5 * GiB + (3 << 20) + 4097, 200_003), ((4 << 30) - 4096, 12_288)]
    for offset, nbytes in cases:
        data = torch.from_numpy(rng.integers(0, 256, nbytes, dtype=np.uint8))
        handle.write(data, path, offset).wait()
        with open(path, "rb") as f:
            assert os.pread(f.fileno(), nbytes, offset) == data.numpy().tobytes()
        out = aio.aligned_empty(nbytes)
        assert handle.read(out, path, offset).wait() == nbytes
        assert torch.equal(out, data)
    st = os.stat(path)
    assert st.st_size == cases[1][0] + cases[1][1] and st.st_blocks * 512 < 64 << 20  # sparse


def _sampled_windows(nbytes: int) -> list[tuple[int, int]]:
    """Disjoint (offset, length) windows of 2,000 bytes: at the start, across 2**31, at the
    end (past 2**31) and at random places."""
    length = 2000
    rng = random.Random(9)
    starts = [0, (1 << 31) - length // 2, nbytes - length]
    while len(starts) < 10:
        start = rng.randrange(0, nbytes - length)
        if all(abs(start - other) >= length for other in starts):
            starts.append(start)
    assert all(abs(a - b) >= length for a in starts for b in starts if a != b)
    return [(start, length) for start in starts]


def test_a_buffer_past_2_gib_reads_from_a_sparse_file(handle, tmp_path):
    """Holes read as zeros without disk I/O, so the whole 2 GiB read costs no disk space."""
    path = tmp_path / "sparse"
    windows = _sampled_windows(BIG_NBYTES)
    with open(path, "wb") as f:
        f.truncate(BIG_NBYTES)
        for i, (start, length) in enumerate(windows):
            os.pwrite(f.fileno(), bytes([i + 1]) * length, start)
    buffer = aio.aligned_empty(BIG_NBYTES)
    try:
        buffer[::1 << 20].fill_(0xEE)  # a byte per MiB the read must overwrite
        assert handle.read(buffer, path).wait() == BIG_NBYTES
        for i, (start, length) in enumerate(windows):
            assert torch.all(buffer[start:start + length] == i + 1), (start, length)
        hole = buffer[(1 << 31) + 20_000:(1 << 31) + 4096 * 4 + 20_000]
        assert not torch.any(hole) and not torch.any(buffer[::1 << 20] == 0xEE)
    finally:
        del buffer


def test_a_tensor_past_2_gib_round_trips(small_tmpfs):
    """Written whole, checked in sampled windows against os.pread, then read back into the
    same memory after those windows were wiped (one 2 GiB buffer: RAM stays under 2.2 GB).
    The file lives on a tmpfs (memory, freed at unmount): the shared disk takes no test data
    over 1 GB. tmpfs refuses O_DIRECT, so this covers the cutting of a >2^31-byte request;
    the O_DIRECT path past 2^31 is covered by the sparse read above."""
    mount = small_tmpfs(f"{BIG_NBYTES + (64 << 20)}")
    if mount is None:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    path = mount / "big"
    tensor = aio.aligned_empty(BIG_NBYTES)
    try:
        torch.arange(BIG_NBYTES // 8, dtype=torch.int64, out=tensor.view(torch.int64))
        windows = _sampled_windows(BIG_NBYTES)
        expected = [tensor[start:start + length].clone() for start, length in windows]
        with aio.Handle() as h:
            assert h.write(tensor, path).wait() == BIG_NBYTES
            with open(path, "rb") as f:
                for (start, length), want in zip(windows, expected):
                    assert os.pread(f.fileno(), length, start) == want.numpy().tobytes(), start
            for start, length in windows:
                tensor[start:start + length].zero_()
            assert h.read(tensor, path).wait() == BIG_NBYTES
        for (start, length), want in zip(windows, expected):
            assert torch.equal(tensor[start:start + length], want), start
    finally:
        del tensor
