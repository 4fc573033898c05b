"""Saved tensors that view a unit's flat values are saved by position, not by storage.

[Note: saved parameter views] Autograd saves tensors for backward during forward, and many of
them are views of parameters (`weight.t()` inside `linear`, a reshaped weight in attention),
which are views of a fetched unit's block in the store. That block is released after the
module's forward and may hold another unit's values by the time backward runs. The pack hook
therefore replaces a saved tensor that lies inside a READY unit's flat tensor by (unit, offset,
size, stride); the unpack hook rebuilds the view from the unit's values as they are when
backward needs them, fetching the unit if nothing did yet (it is then held until its gradients
are final, as a module's backward fetch is). DeepSpeed replaces `F.linear` for the same reason;
this covers every op.
"""

from __future__ import annotations

import bisect
from typing import Any, NamedTuple

import torch

from infinity.zero._common import UnitState
from infinity.zero.unit import FetchUnit


class SavedView(NamedTuple):
    """A saved tensor, as a strided view of its unit's flat values."""

    unit: FetchUnit
    offset: int  # elements from the start of the unit's flat tensor
    size: tuple[int, ...]
    stride: tuple[int, ...]


class ViewIndex:
    """READY units by the address range of their flat tensors, for the pack hook."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._units: list[FetchUnit] = []

    def add(self, unit: FetchUnit) -> None:
        start = unit.flat.data_ptr()
        i = bisect.bisect_left(self._starts, start)
        self._starts.insert(i, start)
        self._units.insert(i, unit)

    def remove(self, unit: FetchUnit) -> None:
        i = self._units.index(unit)
        del self._starts[i], self._units[i]

    def find(self, t: torch.Tensor) -> FetchUnit | None:
        """The READY unit whose flat tensor holds t's first element, if any."""
        ptr = t.data_ptr()
        i = bisect.bisect_right(self._starts, ptr) - 1
        if i < 0:
            return None
        unit = self._units[i]
        flat = unit.flat
        if ptr >= self._starts[i] + flat.numel() * flat.element_size() or t.dtype != flat.dtype \
                or t.device != flat.device:
            return None
        return unit


def pack_saved(index: ViewIndex, t: torch.Tensor) -> Any:
    unit = index.find(t) if t.numel() else None
    if unit is None:
        return t
    offset = (t.data_ptr() - unit.flat.data_ptr()) // t.element_size()
    return SavedView(unit, offset, tuple(t.shape), tuple(t.stride()))


def unpack_saved(coordinator: Any, saved: Any) -> torch.Tensor:
    if not isinstance(saved, SavedView):
        return saved
    unit = saved.unit
    if unit.state is not UnitState.READY or not unit.held_for_backward:
        coordinator.acquire_for_backward([unit])
    flat = unit.flat
    return flat.as_strided(saved.size, saved.stride, flat.storage_offset() + saved.offset)
