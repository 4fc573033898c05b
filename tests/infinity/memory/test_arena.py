"""Arena basics: alignment, views, stats, errors, threads."""

import threading

import pytest
import torch

from infinity.errors import BudgetError, ClosedError
from infinity.memory import Arena, ArenaStats


def test_arena_is_page_aligned_and_blocks_are_aligned():
    for alignment in (16, 256, 4096, 8192):
        with Arena(1 << 20, pinned=False, alignment=alignment) as arena:
            base = arena.alloc(1, torch.uint8)
            assert base.tensor.data_ptr() % max(4096, alignment) == 0
            for n in (1, 3, 100, 1000):
                block = arena.alloc(n, torch.float32)
                assert block.tensor.data_ptr() % alignment == 0
                assert block.offset % alignment == 0


def test_capacity_rounds_up_to_alignment():
    arena = Arena(1000, pinned=False, alignment=256)
    assert arena.capacity_nbytes == 1024
    assert arena.stats().free_nbytes == 1024


def test_block_tensor_is_a_view_with_shape_and_dtype():
    arena = Arena(1 << 16, pinned=False)
    block = arena.alloc((3, 5), torch.float64)
    assert block.tensor.shape == (3, 5)
    assert block.tensor.dtype == torch.float64
    assert block.nbytes == 3 * 5 * 8
    block.tensor.copy_(torch.arange(15, dtype=torch.float64).view(3, 5))
    assert torch.equal(block.tensor, torch.arange(15, dtype=torch.float64).view(3, 5))


def test_zero_size_allocations_take_no_space():
    arena = Arena(4096, pinned=False)
    blocks = [
        arena.alloc(0, torch.float32),
        arena.alloc((4, 0), torch.int64),
        arena.alloc((), torch.uint8),
    ]
    assert blocks[0].tensor.numel() == 0
    assert blocks[1].tensor.shape == (4, 0)
    assert blocks[2].tensor.shape == ()  # a scalar has one element
    stats = arena.stats()
    assert stats.live_nbytes == 256
    assert stats.live_blocks == 3
    assert stats.allocations == 3
    for block in blocks:
        arena.free(block)
    assert arena.stats().free_nbytes == 4096
    assert arena.stats().live_blocks == 0


def test_stats_are_exact():
    arena = Arena(10 * 1024, pinned=False, alignment=1024)
    a = arena.alloc(1024, torch.uint8)
    b = arena.alloc(1500, torch.uint8)  # spans 2048
    c = arena.alloc(1024, torch.uint8)
    arena.alloc(1024, torch.uint8)
    assert arena.stats() == ArenaStats(
        capacity_nbytes=10240,
        live_nbytes=5120,
        free_nbytes=5120,
        largest_hole_nbytes=5120,
        fragmentation=0.0,
        live_blocks=4,
        allocations=4,
        compactions=0,
        moved_nbytes=0,
        compaction_s=0.0,
    )
    arena.free(b)
    stats = arena.stats()
    assert (stats.live_nbytes, stats.free_nbytes, stats.largest_hole_nbytes) == (3072, 7168, 5120)
    assert stats.fragmentation == pytest.approx(1 - 5120 / 7168)
    assert stats.live_blocks == 3
    arena.free(a)
    arena.free(c)  # a, b, c coalesce into one hole of 4096 at the start
    stats = arena.stats()
    assert stats.largest_hole_nbytes == 5120
    assert arena._free.holes() == [(0, 4096), (5120, 5120)]


def test_best_fit_picks_the_smallest_hole_that_fits():
    arena = Arena(64 * 256, pinned=False, alignment=256)
    blocks = [arena.alloc(n * 256, torch.uint8) for n in (4, 1, 2, 1, 3, 1)]
    for i in (0, 2, 4):  # holes of 4, 2 and 3 units, separated by live blocks
        arena.free(blocks[i])
    assert arena.alloc(2 * 256, torch.uint8).offset == blocks[2].offset
    assert arena.alloc(3 * 256, torch.uint8).offset == blocks[4].offset
    assert arena.alloc(256, torch.uint8).offset == blocks[0].offset  # lowest of the rest


def test_overflow_raises_budget_error_with_stats_and_changes_nothing():
    arena = Arena(8192, pinned=False)
    block = arena.alloc(4096, torch.uint8)
    before = arena.stats()
    with pytest.raises(BudgetError) as info:
        arena.alloc((1025,), torch.float32)  # 4100 bytes > 4096 free
    message = str(info.value)
    assert "shape=(1025,)" in message
    assert "4096 of 8192 bytes are free" in message
    assert "ArenaStats(" in message
    assert isinstance(info.value, MemoryError)
    assert arena.stats() == before
    assert block.tensor.numel() == 4096


def test_double_free_and_foreign_blocks_raise_value_error():
    arena, other = Arena(4096, pinned=False), Arena(4096, pinned=False)
    block = arena.alloc(10, torch.uint8)
    with pytest.raises(ValueError, match="belongs to"):
        other.free(block)
    arena.free(block)
    with pytest.raises(ValueError, match="double free"):
        arena.free(block)
    with pytest.raises(ValueError, match="was freed"):
        _ = block.tensor
    with pytest.raises(ValueError, match="expected a Block"):
        arena.free("not a block")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nbytes": -1}, "nbytes=-1"),
        ({"nbytes": 4096, "alignment": 100}, "alignment=100"),
        ({"nbytes": 4096, "alignment": 8}, "alignment=8"),
        ({"nbytes": 4096, "device": "meta"}, "device='meta'"),
    ],
)
def test_bad_arguments_name_the_culprit(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Arena(pinned=False, **kwargs)


def test_bad_shape_or_dtype_is_rejected():
    arena = Arena(4096, pinned=False)
    with pytest.raises(ValueError, match="shape="):
        arena.alloc((2, -1), torch.float32)
    with pytest.raises(ValueError, match="dtype="):
        arena.alloc(4, "float32")


def test_closed_arena_refuses_allocations():
    arena = Arena(4096, pinned=False)
    arena.close()
    arena.close()
    with pytest.raises(ClosedError, match="closed"):  # a RuntimeError, as before
        arena.alloc(1, torch.uint8)


def test_pinned_is_false_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present; covered by the CUDA tests")
    assert Arena(4096, pinned=True).pinned is False


def _run_threads(worker, count: int) -> None:
    errors: list[BaseException] = []

    def guarded(tid: int) -> None:
        try:
            worker(tid)
        except BaseException as exc:  # reported to the main thread below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors


def test_threads_keep_their_data_when_no_compaction_is_needed():
    arena = Arena(256 * 1024, pinned=False)

    def worker(tid: int) -> None:
        for i in range(300):
            block = arena.alloc(64 + (i * 37 + tid * 11) % 2000, torch.uint8)
            value = (tid * 31 + i) % 256
            block.tensor.fill_(value)
            assert bool((block.tensor == value).all())
            arena.free(block)

    _run_threads(worker, 4)
    stats = arena.stats()
    assert stats.compactions == 0  # so the views each thread held stayed valid
    assert (stats.live_blocks, stats.allocations) == (0, 1200)
    assert stats.largest_hole_nbytes == stats.capacity_nbytes


def test_threads_keep_the_books_straight_under_compaction():
    arena = Arena(4096, pinned=False)  # small enough that even one thread fragments it

    def worker(tid: int) -> None:
        held = []
        for i in range(500):
            try:
                held.append(arena.alloc(200 + (i * 53 + tid * 17) % 1800, torch.uint8))
            except BudgetError:
                pass
            if len(held) > 2 or (held and i % 3 == 0):
                arena.free(held.pop(i % len(held)))
        for block in held:
            arena.free(block)

    _run_threads(worker, 4)
    stats = arena.stats()
    assert stats.compactions > 0
    assert stats.live_blocks == 0
    assert stats.free_nbytes == stats.largest_hole_nbytes == stats.capacity_nbytes
