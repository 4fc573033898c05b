"""The native sum of squares (the gradient norm's terms and the finiteness check): the same bits
on every ISA, within a double's rounding of the exact sum, non-finite exactly when an element
is, whatever the size and wherever the element lies."""

import math

import pytest
import torch

from infinity.optim import sum_squares

SIZES = (0, 1, 7, 31, 32, 33, 64, 1000, 100_003)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _exact(t: torch.Tensor) -> float:
    """The exact sum of the squares (each exact in double), rounded once."""
    return math.fsum(x * x for x in t.double().tolist())


@pytest.mark.parametrize("dtype", DTYPES)
def test_equals_the_scalar_path_and_the_exact_sum(isa, dtype):
    gen = torch.Generator().manual_seed(0)
    for n in SIZES:
        t = (torch.randn(n, generator=gen) * 5).to(dtype)
        got = sum_squares(t, isa=isa)
        assert got == sum_squares(t, isa="scalar"), (n, isa)
        assert got == pytest.approx(_exact(t), rel=1e-13, abs=0), n
        shifted = torch.empty(n + 1, dtype=dtype)[1:]  # element- but not vector-aligned
        shifted.copy_(t)
        assert sum_squares(shifted, isa=isa) == got


def test_extremes_square_exactly_and_stay_finite(isa):
    """float32's largest values square far below a double's range; its smallest subnormals
    square above a double's; fp16 subnormals widen exactly."""
    big = torch.full((70,), torch.finfo(torch.float32).max)
    assert sum_squares(big, isa=isa) == pytest.approx(70 * 3.4028234663852886e38 ** 2)
    tiny = torch.full((40,), torch.finfo(torch.float32).smallest_normal / 2 ** 23)
    assert sum_squares(tiny, isa=isa) == 40 * (2.0 ** -149) ** 2
    half = torch.full((40,), 2.0 ** -24, dtype=torch.float16)  # fp16's smallest subnormal
    assert sum_squares(half, isa=isa) == 40 * 2.0 ** -48


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_any_non_finite_element_makes_it_non_finite(isa, dtype, bad):
    for n, at in ((1, 0), (33, 5), (33, 32), (100, 63), (100, 99)):  # vector part and the tail
        t = torch.ones(n, dtype=dtype)
        t[at] = bad
        assert not math.isfinite(sum_squares(t, isa=isa)), (n, at)


def test_refuses_what_it_cannot_read():
    with pytest.raises(TypeError, match="float64"):
        sum_squares(torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError, match="not contiguous"):
        sum_squares(torch.ones(6)[::2])
    with pytest.raises(ValueError, match="isa='sse'"):
        sum_squares(torch.ones(3), isa="sse")
    with pytest.raises(ValueError, match="reads host memory; the tensor is on meta"):
        sum_squares(torch.ones(3, device="meta"))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        sum_squares([1.0, 2.0])
