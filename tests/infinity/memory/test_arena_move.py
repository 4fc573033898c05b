"""The moves of a compaction: the native batch against memmoves one after another, and the
torch strategies of the device path, each against a reference."""

import random

import pytest
import torch

from infinity.memory._move import DIRECT_MIN_NBYTES, _bounce, copy_down, move_down
from infinity.memory.thread_pool import ThreadPool

KiB, MiB = 1 << 10, 1 << 20


def _random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def _reference(base: torch.Tensor, moves: list[tuple[int, int, int]]) -> bytes:
    """The moves done one at a time, in order, each as a memmove (a slice copy of a bytearray
    reads the whole source before it writes)."""
    expected = bytearray(base.numpy().tobytes())
    for dst, src, nbytes in moves:
        expected[dst : dst + nbytes] = expected[src : src + nbytes]
    return bytes(expected)


def _batch(base: torch.Tensor, moves: list[tuple[int, int, int]], threads: int) -> None:
    dst, src, nbytes = ([m[i] for m in moves] for i in range(3))
    with ThreadPool(max(threads, 1)) as pool:
        move_down(base, dst, src, nbytes, threads=threads, pool=pool)


def _check_batch(base: torch.Tensor, moves: list[tuple[int, int, int]], threads: int) -> None:
    expected = _reference(base, moves)
    _batch(base, moves, threads)
    assert base.numpy().tobytes() == expected


def _random_compaction(rng: random.Random, capacity: int) -> list[tuple[int, int, int]]:
    """Moves of a compaction's shape with every kind of size and gap: empty moves, moves that
    stay put, runs with no hole between them, tiny and huge holes, targets at the lowest
    place or anywhere between it and the source."""
    sizes = [0, 1, 17, 4 * KiB, 64 * KiB, 64 * KiB + 3, 300 * KiB, 1 * MiB, 3 * MiB + 5]
    holes = [0, 0, 1, 256, 4 * KiB, 64 * KiB, 700 * KiB, 2 * MiB]
    moves: list[tuple[int, int, int]] = []
    src = dst = rng.randrange(0, 4096)
    while True:
        src += rng.choice(holes)
        nbytes = rng.choice(sizes) if rng.random() < 0.3 else rng.randint(1, 2 * MiB)
        if src + nbytes > capacity:
            return moves
        roll = rng.random()
        target = dst if roll < 0.8 else src if roll < 0.9 else rng.randint(dst, src)
        moves.append((target, src, nbytes))
        src += nbytes
        dst = target + nbytes


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_random_compactions_match_memmoves_in_order(threads):
    rng = random.Random(threads)
    capacity = 16 * MiB
    for trial in range(8):
        base = _random_bytes(capacity, seed=trial)
        moves = _random_compaction(rng, capacity)
        _check_batch(base, moves, threads)


@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize(
    ("block", "hole"),
    [(64 * KiB, 4 * KiB), (64 * KiB, 64 * KiB), (1 * MiB, 1 * MiB), (1 * MiB, 100 * KiB),
     (260 * KiB, 4 * KiB), (260 * KiB, 37 * KiB)],
)
def test_benchmark_patterns_match_memmoves_in_order(threads, block, hole):
    """Live blocks and holes alternating, as in tools/bench_arena.py: small holes make chains of
    dependent moves, then moves that depend on ones far behind. Twice, to give races a chance."""
    capacity = 24 * MiB
    moves, cursor, at = [], 0, hole
    while at + block <= capacity:
        moves.append((cursor, at, block))
        cursor, at = cursor + block, at + block + hole
    for repeat in range(2):
        _check_batch(_random_bytes(capacity, seed=repeat), moves, threads)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "moves",
    [
        [],
        [(0, 0, 0)],
        [(0, 100, 0), (0, 100, 0), (5, 200, 0)],  # empty moves copy nothing
        [(0, 0, 5 * MiB), (5 * MiB, 6 * MiB, 1000)],  # the first stays put
        [(0, 1, 6 * MiB)],  # overlaps itself all but one byte
        [(0, 7 * MiB, 3 * MiB)],  # no overlap at all
        [(0, 3 * MiB, 3 * MiB), (3 * MiB, 6 * MiB, 3 * MiB)],  # each lands on the last source
        [(10, 4 * MiB, 2 * MiB), (2 * MiB + 10, 6 * MiB, 0), (2 * MiB + 10, 6 * MiB, 4 * MiB)],
    ],
    ids=["none", "empty", "empties", "stays", "gap-1", "apart", "on-last-source", "mixed"],
)
def test_chosen_moves_match_memmoves_in_order(moves, threads):
    _check_batch(_random_bytes(11 * MiB, seed=1), moves, threads)


@pytest.mark.parametrize(
    ("moves", "threads"),
    [
        ([(10, 5, 1)], 1),  # target above its source
        ([(-1, 5, 1)], 1),
        ([(0, 5, -1)], 1),
        ([(0, 1000, 25)], 1),  # past the end
        ([(0, 1 << 62, 1 << 62)], 1),
        ([(0, 100, 50), (50, 120, 10)], 1),  # sources overlap
        ([(0, 100, 50), (40, 200, 10)], 1),  # targets overlap
        ([(50, 100, 10), (0, 200, 10)], 1),  # targets descend
        ([(0, 100, 10)], 0),
    ],
)
def test_moves_of_another_shape_are_refused_before_any_copy(moves, threads):
    base = _random_bytes(1024, seed=2)
    before = base.clone()
    with pytest.raises(ValueError, match="inf_move_down_batch refused"):
        _batch(base, moves, threads)
    assert torch.equal(base, before)


def test_mismatched_lists_and_bad_buffers_are_refused():
    base = torch.zeros(64, dtype=torch.uint8)
    with pytest.raises(ValueError, match="2 targets, 1 sources"):
        move_down(base, [0, 1], [2], [1])
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        move_down(torch.zeros(16, dtype=torch.int32), [0], [4], [4])


@pytest.mark.parametrize(
    ("gap", "nbytes"),
    [
        (0, 1000),
        (1, 1000),
        (256, 3 << 20),
        (DIRECT_MIN_NBYTES, 3 * DIRECT_MIN_NBYTES + 17),
        (DIRECT_MIN_NBYTES + 5, 4 * DIRECT_MIN_NBYTES),
        (5 << 20, 1 << 20),  # no overlap at all
    ],
)
def test_copy_down_matches_a_memmove(gap, nbytes):
    """The device path's strategies (bounce, gap-sized pieces, one copy), run on the host."""
    base = _random_bytes(gap + nbytes + 512, seed=gap)
    dst = 128
    expected = _reference(base, [(dst, dst + gap, nbytes)])
    copy_down(base, dst, dst + gap, nbytes, scratch=torch.empty(4096, dtype=torch.uint8))
    assert base.numpy().tobytes() == expected


def test_copy_down_needs_a_scratch_for_a_small_gap():
    base = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(ValueError, match="needs a scratch buffer"):
        copy_down(base, 0, 16, 1024, scratch=None)


def test_bounce_is_correct_for_any_scratch_size():
    rng = random.Random(0)
    for _ in range(200):
        nbytes = rng.randint(1, 5000)
        gap = rng.randint(1, 3000)
        dst = rng.randint(0, 100)
        scratch = torch.empty(rng.randint(1, 700), dtype=torch.uint8)
        base = torch.randint(0, 256, (dst + gap + nbytes + 10,), dtype=torch.uint8)
        expected = _reference(base, [(dst, dst + gap, nbytes)])
        _bounce(base, dst, dst + gap, nbytes, scratch)
        assert base.numpy().tobytes() == expected
