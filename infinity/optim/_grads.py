"""The gradients the swapped optimizer takes: checked before any state is touched, and read by
element range where they lie (a unit's parameters' own gradients, never joined)."""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Iterator, Sequence

import torch

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_grad(name: str, grad: object, numel: int) -> torch.Tensor:
    """Refuse, before any state is touched, a gradient the kernel would reject part-way through
    a step (which would leave some tiles updated and others not)."""
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(grad).__name__}")
    if grad.device.type != "cpu" or grad.layout != torch.strided:
        raise ValueError(f"{name} must be a dense CPU tensor, got {grad.device} / {grad.layout}")
    if grad.dtype not in GRAD_DTYPES:
        raise TypeError(f"{name} has dtype {grad.dtype}; expected float32, bfloat16 or float16")
    if grad.numel() != numel or not grad.is_contiguous():
        raise ValueError(f"{name} must be contiguous with {numel} elements, got shape "
                         f"{tuple(grad.shape)}, contiguous={grad.is_contiguous()}")
    return grad


def check_grad_pieces(name: str, grad: object, numel: int) -> GradPieces:
    """`check_grad` for a gradient given whole (a 1-D tensor) or as 1-D tensors laid end to
    end; returns it as GradPieces."""
    def one_d(label: str, piece: object, expected: int) -> torch.Tensor:
        check_grad(label, piece, expected)
        if piece.dim() != 1:
            raise ValueError(f"{label} must be 1-D, got shape {tuple(piece.shape)}")
        return piece

    if isinstance(grad, torch.Tensor):
        return GradPieces([one_d(name, grad, numel)])
    if not isinstance(grad, (list, tuple)) or not grad:
        raise TypeError(f"{name} must be a 1-D tensor or a non-empty list of them, got "
                        f"{type(grad).__name__}")
    pieces = GradPieces([one_d(f"{name} (piece {k})", piece,
                               piece.numel() if isinstance(piece, torch.Tensor) else -1)
                         for k, piece in enumerate(grad)])
    if pieces.numel != numel:
        raise ValueError(f"{name}: the pieces must lay {numel} elements end to end, got "
                         f"{pieces.numel}")
    return pieces


def all_finite(t: torch.Tensor) -> bool:
    """No inf/nan in `t`: one pass (a sum, which any inf/nan makes non-finite; float16 is
    summed in float32 not to overflow)."""
    return math.isfinite(float(t.sum(dtype=torch.float32 if t.dtype == torch.float16 else None)))


class GradPieces:
    """A unit's gradient as 1-D tensors laid end to end (an engine unit's parameters' own
    gradients), read by element range without being joined into one buffer."""

    def __init__(self, pieces: Sequence[torch.Tensor]) -> None:
        self.pieces = list(pieces)
        self.starts = [0, *itertools.accumulate(p.numel() for p in self.pieces)]

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def ranges(self, start: int, stop: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(first element, the gradient of elements [first, ...)) covering [start, stop)."""
        k = bisect.bisect_right(self.starts, start) - 1
        while start < stop:
            base, piece = self.starts[k], self.pieces[k]
            end = min(stop, base + piece.numel())
            if end > start:
                yield start, piece[start - base:end - base]
            start, k = end, k + 1
