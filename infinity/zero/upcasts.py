"""UpcastBuffers: the wider copies of units computed in a wider dtype than they are stored in,
made in buffers that are used again instead of fresh memory each time.

[Note: reused upcast buffers] Without bf16 units a bf16 unit is upcast to fp32 each time it is
used: twice a step for every unit, 27 GB of fp32 copies a pass for the 7 B Llama. Fresh, each
copy is a new mapping the kernel faults in and zeroes before the copy writes it (the 7 B run on
an AVX2 host spent 15% of the training thread in the upcast and as much time in the kernel as in
user code). Here a released copy's buffer is kept and the next unit of the same size is copied
into it (180 MB: 14-33 ms fresh, 9 ms into a kept buffer, on that host). A buffer is kept only
when nothing else holds its memory (no view of it survived its unit's release: a saved tensor
outside `saved_views`' hooks, a caller's reference), so a kept buffer is never written under
anyone. What is lent plus what is kept stays within `capacity` bytes, the copies the memory
plan sets aside ([Note: what computing holds outside the store] in infinity/engine/_plan.py),
by dropping the longest-kept buffers first; a unit lent beyond it is still copied, fresh.
"""

from __future__ import annotations

from collections import OrderedDict

import torch


def sole_owner(t: torch.Tensor) -> bool:
    """Whether `t` is the only tensor using its memory (no view of it is alive)."""
    storage = t.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) == 2  # t's and `storage`'s own


class UpcastBuffers:
    """Buffers for wider copies of flat units, kept between uses; see [Note: reused upcast
    buffers]. Not thread-safe: the coordinator calls it under its lock."""

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.lent_bytes = 0
        self.kept_bytes = 0
        self.reused = 0  # copies made into a kept buffer
        self.fresh = 0  # copies made into new memory
        self._kept: OrderedDict[int, tuple[torch.Tensor, tuple]] = OrderedDict()  # oldest first

    def copy(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`flat` converted to `dtype`, into a kept buffer of its shape when there is one."""
        key = (flat.numel(), dtype, flat.device)
        buf = self._take(key)
        if buf is None:
            self._trim(flat.numel() * dtype.itemsize)
            buf = torch.empty(flat.numel(), dtype=dtype, device=flat.device)
            self.fresh += 1
        else:
            self.reused += 1
        self.lent_bytes += buf.nbytes
        return buf.copy_(flat)

    def give_back(self, buf: torch.Tensor) -> None:
        """Take back a buffer from `copy` once its unit let go of it: kept if nothing else
        uses its memory and it fits within the capacity."""
        self.lent_bytes -= buf.nbytes
        if not sole_owner(buf):
            return
        self._kept[id(buf)] = (buf, (buf.numel(), buf.dtype, buf.device))
        self.kept_bytes += buf.nbytes
        self._trim(0)

    def _take(self, key: tuple) -> torch.Tensor | None:
        for ident, (buf, k) in reversed(self._kept.items()):  # the latest kept: warm in cache
            if k == key:
                del self._kept[ident]
                self.kept_bytes -= buf.nbytes
                return buf
        return None

    def _trim(self, coming: int) -> None:
        """Drop the longest-kept buffers until lent, kept and `coming` bytes fit."""
        while self._kept and self.lent_bytes + self.kept_bytes + coming > self.capacity:
            _, (buf, _) = self._kept.popitem(last=False)
            self.kept_bytes -= buf.nbytes
