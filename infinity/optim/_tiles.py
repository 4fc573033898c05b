"""How the swapped optimizer cuts its state into tiles, and the values a pass over tiles updates.

A tile is one store entry of shape (rows, n): [master,] exp_avg, exp_avg_sq for n elements of
one or more "groups" (a parameter, or an engine fetch unit). Rows and grouping are decided here;
the streaming itself is in `infinity.optim.swapped`.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch

from infinity.store import TensorStore, Tier

logger = logging.getLogger(__name__)

GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class UnitSpec(NamedTuple):
    """One engine fetch unit: a module's parameters flattened into one 1-D store entry; or,
    with several data-parallel ranks, the slice of it this rank's optimizer owns."""

    numel: int  # elements stepped: the unit's flat values, or this rank's slice of them
    dtype: torch.dtype  # float32 / bfloat16 / float16, as the model stores them
    values_key: str  # store key of a 1-D entry of `dtype` holding the unit's values
    offset: int = 0  # first element stepped in the values entry (it holds offset + numel or more)


class Segment(NamedTuple):
    """The part of one group (parameter or unit) that falls in one tile."""

    param: int  # index of the parameter (param mode) or unit (unit mode)
    param_offset: int  # first element in the flattened group
    tile_offset: int  # first element in the tile
    numel: int


def cut_tiles(numels: Sequence[int], tile_numel: int) -> list[list[Segment]]:
    """Cut groups laid end to end into tiles of tile_numel elements (the last may be short):
    a tile may span several groups (param mode, DeepSpeed's sub groups)."""
    tiles: list[list[Segment]] = [[]]
    used = 0
    for i, numel in enumerate(numels):
        done = 0
        while done < numel:
            if used == tile_numel:
                tiles.append([])
                used = 0
            take = min(numel - done, tile_numel - used)
            tiles[-1].append(Segment(i, done, used, take))
            used += take
            done += take
    return [t for t in tiles if t]


def cut_per_group(numels: Sequence[int], tile_numel: int) -> list[list[Segment]]:
    """Cut each group on its own (unit mode): a tile never spans two groups, so a unit can be
    stepped as soon as its gradient is final."""
    return [[Segment(i, start, 0, min(tile_numel, numel - start))]
            for i, numel in enumerate(numels) for start in range(0, numel, tile_numel)]


def tile_numel_of(segments: Sequence[Segment]) -> int:
    last = segments[-1]
    return last.tile_offset + last.numel


def spans(seg: Segment) -> tuple[slice, slice]:
    """The segment's elements in its group's flat values, and its columns in the tile."""
    return (slice(seg.param_offset, seg.param_offset + seg.numel),
            slice(seg.tile_offset, seg.tile_offset + seg.numel))


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
        raise TypeError(f"{name} must be a 1-D tensor or a non-empty list of them, got {type(grad).__name__}")
    pieces = GradPieces([one_d(f"{name} (piece {k})", piece, piece.numel() if isinstance(piece, torch.Tensor) else -1)
                         for k, piece in enumerate(grad)])
    if pieces.numel != numel:
        raise ValueError(f"{name}: the pieces must lay {numel} elements end to end, got {pieces.numel}")
    return pieces


def all_finite(t: torch.Tensor) -> bool:
    """No inf/nan in `t`: one pass (a sum, which any inf/nan makes non-finite; float16 is
    summed in float32 not to overflow)."""
    return math.isfinite(float(t.sum(dtype=torch.float32 if t.dtype == torch.float16 else None)))


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


class GradPieces:
    """A group's gradient as 1-D tensors laid end to end (an engine unit's parameters' own
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


class GroupValues:
    """The values of each group during one pass over tiles: a host tensor, or a store entry
    fetched to the host tier on first use and released (written back if changed) by
    `release`, so an entry spanning many tiles is read and written once per pass.

    Every fetch is released by `release_all` on every path, modified entries dirty: their
    tiles already record the step, so the new values must reach the store."""

    def __init__(self, store: TensorStore, keys: Sequence[str | None],
                 host: Sequence[torch.Tensor] | None, numels: Sequence[int],
                 dtypes: Sequence[torch.dtype], offsets: Sequence[int] | None = None) -> None:
        self._store, self._keys, self._host = store, keys, host
        self._numels, self._dtypes = numels, dtypes
        self._offsets = offsets if offsets is not None else [0] * len(numels)
        self._held: dict[int, list] = {}  # group -> [tensor or None while reading, modified]

    def get(self, i: int) -> torch.Tensor:
        """The flat values of group i (its slice of the store entry)."""
        key = self._keys[i]
        if key is None:
            return self._host[i].data.view(-1)
        held = self._held.get(i)
        if held is None:
            future = self._store.fetch(key, Tier.HOST)
            held = self._held[i] = [None, False]  # a use is taken: released even if the read fails
            value = future.result()
            start, stop = self._offsets[i], self._offsets[i] + self._numels[i]
            if value.numel() < stop or value.dtype != self._dtypes[i]:
                raise ValueError(f"store entry {key!r} holds {value.numel()} x {value.dtype}; expected "
                                 f"{stop if start == 0 else f'[{start}:{stop}] of'} x {self._dtypes[i]}")
            held[0] = value.view(-1)[start:stop]
        return held[0]

    def modified(self, i: int) -> None:
        if i in self._held:
            self._held[i][1] = True

    def release(self, i: int) -> None:
        held = self._held.pop(i, None)
        if held is not None:
            self._store.release(self._keys[i], Tier.HOST, dirty=held[1])

    def release_all(self) -> None:
        """Release everything still held; raises the first error after trying them all."""
        error = None
        for i in list(self._held):
            try:
                self.release(i)
            except Exception as exc:  # noqa: BLE001 - keep releasing, re-raised below
                error = error or exc
        if error is not None:
            raise error
