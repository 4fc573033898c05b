"""The overlap-safe downward move used by compaction, every strategy against a reference."""

import random

import pytest
import torch

from infinity.memory._move import DIRECT_MIN_NBYTES, _bounce, move_down


def _reference(base: torch.Tensor, dst: int, src: int, nbytes: int) -> torch.Tensor:
    expected = base.clone()
    expected[dst : dst + nbytes] = base[src : src + nbytes].clone()
    return expected


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
def test_move_down_matches_a_copy_through_a_temporary(gap, nbytes):
    base = torch.randint(0, 256, (gap + nbytes + 512,), dtype=torch.uint8)
    dst = 128
    expected = _reference(base, dst, dst + gap, nbytes)
    move_down(base, dst, dst + gap, nbytes, scratch=None)
    assert torch.equal(base, expected)


def test_bounce_is_correct_for_any_scratch_size():
    rng = random.Random(0)
    for _ in range(200):
        nbytes = rng.randint(1, 5000)
        gap = rng.randint(1, 3000)
        dst = rng.randint(0, 100)
        scratch = torch.empty(rng.randint(1, 700), dtype=torch.uint8)
        base = torch.randint(0, 256, (dst + gap + nbytes + 10,), dtype=torch.uint8)
        expected = _reference(base, dst, dst + gap, nbytes)
        _bounce(base, dst, dst + gap, nbytes, scratch)
        assert torch.equal(base, expected)
