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
        self.reused = 0  # copies made into a kept buffer
        self.fresh = 0  # copies made into new memory
        self._kept: list[torch.Tensor] = []  # oldest first

    @property
    def kept_bytes(self) -> int:
        return sum(buf.nbytes for buf in self._kept)

    def copy(self, flat: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`flat` converted to `dtype`, into a kept buffer of its shape when there is one."""
        buf = self._take(flat.numel(), dtype, flat.device)
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
        if sole_owner(buf):
            self._kept.append(buf)
            self._trim(0)

    def clear(self) -> None:
        """Let every kept buffer go (the engine closes: nothing will be copied again)."""
        self._kept.clear()

    def _take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        for i in reversed(range(len(self._kept))):  # the latest kept first: warm in cache
            buf = self._kept[i]
            if buf.numel() == numel and buf.dtype == dtype and buf.device == device:
                return self._kept.pop(i)
        return None

    def _trim(self, coming: int) -> None:
        """Drop the longest-kept buffers until lent, kept and `coming` bytes fit."""
        while self._kept and self.lent_bytes + self.kept_bytes + coming > self.capacity:
            self._kept.pop(0)
