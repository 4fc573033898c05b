"""aio.FreeList: best fit, lowest address among equals, coalescing, against a brute-force model."""

import random

from aio import FreeList


def _model_holes(capacity, used):
    """Holes of [0, capacity) given the used (start, size) ranges, in address order."""
    holes, cursor = [], 0
    for start, size in sorted(used):
        if start > cursor:
            holes.append((cursor, start - cursor))
        cursor = start + size
    if cursor < capacity:
        holes.append((cursor, capacity - cursor))
    return holes


def test_random_take_give_matches_the_model():
    rng = random.Random(3)
    capacity = 1 << 16
    free, used = FreeList(capacity), []
    for _ in range(5000):
        if used and rng.random() < 0.45:
            start, size = used.pop(rng.randrange(len(used)))
            free.give(start, size)
        else:
            size = rng.randrange(1, 2048)
            holes = _model_holes(capacity, used)
            fits = [(s, st) for st, s in holes if s >= size]
            got = free.take(size)
            if not fits:
                assert got is None
                continue
            assert got == min(fits)[1]  # the smallest hole that fits, lowest address among equals
            used.append((got, size))
        holes = _model_holes(capacity, used)
        assert free.holes() == holes  # coalesced: no two holes touch
        assert free.free_nbytes == sum(s for _, s in holes)
        assert free.largest_nbytes == max((s for _, s in holes), default=0)


def test_reset_leaves_one_hole():
    free = FreeList(100)
    assert free.take(40) == 0
    free.reset(70)
    assert free.holes() == [(70, 30)] and free.largest_nbytes == free.free_nbytes == 30
    free.reset(100)
    assert free.holes() == [] and free.take(1) is None
