"""BufferPool: aligned buffers, blocking and timeouts, threads, chunked moves of large tensors."""

import itertools
import os
import threading
import time

import pytest
import torch

from infinity.memory import BufferPool, Chunk, iter_chunks


def test_buffers_are_aligned_distinct_and_sized():
    pool = BufferPool(4, 10_000, pinned=False)
    bufs = [pool.acquire() for _ in range(4)]
    assert sorted(b.index for b in bufs) == [0, 1, 2, 3]
    for buf in bufs:
        assert buf.tensor.numel() == 10_000
        assert buf.tensor.dtype == torch.uint8
        assert buf.tensor.data_ptr() % 4096 == 0
    starts = sorted(b.tensor.data_ptr() for b in bufs)
    assert all(b - a >= 10_000 for a, b in itertools.pairwise(starts))
    for buf in bufs:
        buf.release()
    assert pool.stats().in_use == 0


def test_context_manager_releases_even_on_error():
    pool = BufferPool(1, 4096, pinned=False)
    with pytest.raises(KeyError):
        with pool.acquire() as buf:
            buf.tensor.fill_(1)
            raise KeyError("boom")
    with pool.acquire(timeout_s=0) as buf:
        assert buf.index == 0


def test_double_release_and_foreign_buffers_raise_value_error():
    pool, other = BufferPool(1, 4096, pinned=False), BufferPool(1, 4096, pinned=False)
    buf = pool.acquire()
    with pytest.raises(ValueError, match="does not belong"):
        other.release(buf)
    pool.release(buf)
    with pytest.raises(ValueError, match="released twice"):
        buf.release()
    assert pool.stats().in_use == 0


def test_timeout_names_the_pool_size():
    pool = BufferPool(2, 4096, pinned=False)
    held = [pool.acquire(), pool.acquire()]
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="all 2 buffers of 4096 bytes"):
        pool.acquire(timeout_s=0.2)
    assert time.monotonic() - t0 >= 0.2
    with pytest.raises(TimeoutError):
        pool.acquire(timeout_s=0)
    stats = pool.stats()
    assert (stats.in_use, stats.waits, stats.acquisitions) == (2, 2, 2)
    assert stats.wait_s >= 0.2
    for buf in held:
        buf.release()


def test_acquire_blocks_until_a_buffer_is_released():
    pool = BufferPool(1, 4096, pinned=False)
    first = pool.acquire()
    got = threading.Event()

    def waiter() -> None:
        with pool.acquire(timeout_s=10):
            got.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    assert not got.wait(0.2)  # blocked while the only buffer is out
    first.release()
    assert got.wait(10)
    thread.join()


def test_close_wakes_waiters_and_refuses_acquire():
    pool = BufferPool(1, 4096, pinned=False)
    pool.acquire()
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            pool.acquire(timeout_s=10)
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.1)
    pool.close()
    thread.join(10)
    assert len(errors) == 1 and "closed" in str(errors[0])
    with pytest.raises(RuntimeError, match="closed"):
        pool.acquire()


def test_threads_never_share_a_buffer():
    pool = BufferPool(3, 4096, pinned=False)
    lock = threading.Lock()
    holders: set[int] = set()
    peak = [0]
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        try:
            for i in range(150):
                with pool.acquire(timeout_s=10) as buf:
                    with lock:
                        assert buf.index not in holders
                        holders.add(buf.index)
                        peak[0] = max(peak[0], len(holders))
                    value = (tid * 7 + i) % 256
                    buf.tensor.fill_(value)
                    time.sleep(0)  # let others run while this buffer is held
                    assert bool((buf.tensor == value).all())
                    with lock:
                        holders.remove(buf.index)
        except BaseException as exc:  # reported to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert peak[0] <= 3
    stats = pool.stats()
    assert (stats.in_use, stats.acquisitions) == (0, 1200)


def test_iter_chunks_covers_the_range_exactly():
    assert list(iter_chunks(0, 10)) == []
    assert list(iter_chunks(20, 10)) == [Chunk(0, 10), Chunk(10, 10)]
    assert list(iter_chunks(25, 10)) == [Chunk(0, 10), Chunk(10, 10), Chunk(20, 5)]
    with pytest.raises(ValueError, match="chunk_nbytes=0"):
        list(iter_chunks(10, 0))
    with pytest.raises(ValueError, match="total_nbytes=-1"):
        list(iter_chunks(-1, 10))


def test_tensor_ten_times_the_buffer_size_moves_through_a_file(tmp_path):
    pool = BufferPool(2, 64 * 1024, pinned=False)
    src = torch.randn(10 * 64 * 1024 // 4 + 1001)  # 10 buffers and a ragged tail
    path = tmp_path / "tensor.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:

        def write(chunk: torch.Tensor, offset: int) -> None:
            assert chunk.numel() <= pool.nbytes
            assert os.pwrite(fd, chunk.numpy().tobytes(), offset) == chunk.numel()

        def read(chunk: torch.Tensor, offset: int) -> None:
            data = os.pread(fd, chunk.numel(), offset)
            chunk.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))

        assert pool.copy_out(src, write) == src.numel() * 4
        assert os.path.getsize(path) == src.numel() * 4
        dst = torch.empty_like(src)
        assert pool.copy_in(dst, read) == src.numel() * 4
    finally:
        os.close(fd)
    assert torch.equal(dst, src)
    assert len(list(pool.chunks(src.numel() * 4))) == 11
    assert pool.stats().in_use == 0


def test_copy_refuses_non_contiguous_tensors():
    pool = BufferPool(1, 4096, pinned=False)
    with pytest.raises(ValueError, match="not contiguous"):
        pool.copy_out(torch.zeros(8, 8).t(), lambda chunk, offset: None)


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0, 4096), {}, "count=0"),
        ((1, 0), {}, "nbytes=0"),
        ((1, 4096), {"alignment": 3000}, "alignment=3000"),
    ],
)
def test_bad_arguments_name_the_culprit(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        BufferPool(*args, pinned=False, **kwargs)


def test_negative_timeout_is_rejected():
    with pytest.raises(ValueError, match="timeout_s=-1"):
        BufferPool(1, 4096, pinned=False).acquire(timeout_s=-1)
