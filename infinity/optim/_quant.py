"""Block-wise 8-bit codes of Adam's moments, in plain torch: the rules the native kernel
(csrc/adam/adam_state_kernel.h) follows bit for bit, used where state leaves or enters the
kernel's format (checkpoints, torch state dicts) and by the kernel's reference in the tests.

[Note: 8-bit moments] A row of n moments is cut into blocks of `block` elements (the last may
be short), each stored as one float32 scale and one byte per element:

- scale = the block's largest magnitude (0 for an all-zero block, NaN for a block holding an
  inf or NaN); every element is coded from y = x * (1 / scale), or x / scale where the scale
  or its inverse is not a normal float: |y| <= 1 but for an ulp, and the largest rounds to 1.
- a byte is an 8-bit float without inf or NaN codes: `exp_bits` exponent bits, `man_bits`
  mantissa bits, a sign bit for the signed map (exp_avg) and none for the unsigned one
  (exp_avg_sq). Its top exponent is the binade of 1.0, of which only 1.0 itself is used;
  below the smallest binade are subnormal codes spaced like the smallest binade's.
- y is rounded to the nearest code, ties to the even code (`encode` says how, exactly, in
  bit operations a vector unit does fast). With `keep_nonzero`, a positive y
  that would round to 0 gets the smallest positive code instead (for exp_avg_sq: a zero there
  would turn m / sqrt(v) into m / eps).
- a byte decodes to code_value * scale (one float32 multiply).

The scale keeps the block's largest element exact, and with it the block's common decay: each
step multiplies v by beta2 = 0.999, a change 8-bit codes cannot hold (their steps are 3-6%), so a
scale rounded to a power of two, say, would freeze v and slow training (docs/store.md).
Why these maps and block size: docs/store.md "Optimizer state formats".
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class Code8(NamedTuple):
    """An 8-bit floating-point code map (see [Note: 8-bit moments])."""

    exp_bits: int
    man_bits: int
    signed: bool
    keep_nonzero: bool = False  # a positive value never rounds to code 0

    @property
    def bias(self) -> int:
        """Exponent bias: the largest exponent field, 2**exp_bits - 1, is the binade of 1."""
        return (1 << self.exp_bits) - 1

    @property
    def magnitude_codes(self) -> int:
        return 1 << (self.exp_bits + self.man_bits)

    def magnitudes(self) -> torch.Tensor:
        """Value of each magnitude code (float64, exact in float32), ascending: exponent field
        e and mantissa f are (1 + f / 2**man_bits) * 2**(e - bias), or for e = 0 (subnormal
        codes) f / 2**man_bits * 2**(1 - bias)."""
        c = torch.arange(self.magnitude_codes, dtype=torch.float64)
        frac = torch.remainder(c, 1 << self.man_bits) / (1 << self.man_bits)
        exp = torch.div(c, 1 << self.man_bits, rounding_mode="floor")
        sub = math.ldexp(1.0, 1 - self.bias)
        return torch.where(exp == 0, frac * sub, (1 + frac) * torch.exp2(exp - self.bias))

    def table(self) -> torch.Tensor:
        """float32 value of each of the 256 byte values (sign in bit 7 for a signed map)."""
        mags = self.magnitudes().float()
        return torch.cat([mags, -mags]) if self.signed else mags


FLT_MIN = 2.0**-126  # the smallest normal float32
EXP_AVG_CODE = Code8(exp_bits=3, man_bits=4, signed=True)
EXP_AVG_SQ_CODE = Code8(exp_bits=4, man_bits=4, signed=False, keep_nonzero=True)
DEFAULT_BLOCK = 256


def _check_row(x: torch.Tensor, block: int) -> None:
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    if x.dim() != 1:
        raise ValueError(f"expected a 1-D row, got shape {tuple(x.shape)}")


def block_count(numel: int, block: int) -> int:
    """Blocks (and scales) of a row of numel elements."""
    return -(-numel // block)


def _blocked(x: torch.Tensor, block: int, fill: float) -> torch.Tensor:
    """x as (blocks, block), the short last block padded with `fill`."""
    pad = block_count(x.numel(), block) * block - x.numel()
    if pad:
        x = torch.cat([x, x.new_full((pad,), fill)])
    return x.view(-1, block)


def block_scales(x: torch.Tensor, block: int) -> torch.Tensor:
    """Each block's scale: its largest magnitude; NaN for a block with an inf or NaN."""
    _check_row(x, block)
    blocks = _blocked(x.float(), block, 0.0)
    amax = blocks.abs().amax(dim=1)
    return torch.where(blocks.isfinite().all(dim=1), amax, torch.full_like(amax, math.nan))


def encode(y: torch.Tensor, code: Code8) -> torch.Tensor:
    """Bytes (uint8) of y (float32, |y| < 2), rounded to the nearest code, ties to even (below
    the normal codes through a float32 subnormal first: a value within half a float32
    subnormal step of a midpoint may take the other neighbour)."""
    # |y| * 2**(bias - 127) holds the code's exponent in its own (subnormal codes as float32
    # subnormals, to which it rounds first); its bits rounded to man_bits are the code
    mag = y.abs()
    shift = 23 - code.man_bits
    bits = (mag * math.ldexp(1.0, code.bias - 127)).view(torch.int32).to(torch.int64)
    c = (bits + (1 << (shift - 1)) - 1 + ((bits >> shift) & 1)) >> shift
    c = c.clamp(max=code.magnitude_codes - 1)
    if code.keep_nonzero:
        c = torch.where((c == 0) & (mag > 0), torch.ones_like(c), c)
    if code.signed:
        c = c | (y.signbit().to(torch.int64) << 7)
    return c.to(torch.uint8)


def quantize(x: torch.Tensor, block: int, code: Code8) -> tuple[torch.Tensor, torch.Tensor]:
    """(bytes, scales) of a 1-D float32 row; see [Note: 8-bit moments]."""
    scales = block_scales(x, block)
    usable = (scales > 0) & scales.isfinite()
    blocks = _blocked(x.float(), block, 0.0)
    safe = torch.where(usable, scales, torch.ones_like(scales))
    # one divide per block: the inverse, where it and the scale are normal floats
    normal = (safe >= FLT_MIN) & (safe <= 2.0**126)
    y = torch.where(normal[:, None], blocks * (1.0 / safe)[:, None], blocks / safe[:, None])
    codes = torch.where(usable[:, None], encode(y, code), torch.zeros_like(y, dtype=torch.uint8))
    return codes.reshape(-1)[:x.numel()], scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: int, code: Code8
               ) -> torch.Tensor:
    """float32 row of `codes` (uint8) under their blocks' `scales`."""
    _check_row(codes, block)
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    if scales.numel() != block_count(codes.numel(), block):
        raise ValueError(f"{codes.numel()} codes in blocks of {block} need "
                         f"{block_count(codes.numel(), block)} scales, got {scales.numel()}")
    values = code.table()[codes.long()]
    per_element = scales.float().repeat_interleave(block)[:codes.numel()]
    return values * per_element
