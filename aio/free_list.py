"""Hole bookkeeping for a range of bytes: best-fit search and coalescing, offsets only.

Shared by `SwapFile` (extents of a file) and `infinity.memory.Arena` (blocks of memory).

Holes are kept three ways so that every operation is a dict look-up or a binary search:
by start (to find the hole after a freed range), by end (the hole before it) and in a list
sorted by ``(size, start)`` (best fit: the smallest hole that is large enough, the lowest
address among equals, which keeps live data packed toward the start and compaction cheap).
"""

from __future__ import annotations

import bisect


class FreeList:
    """The free ranges of ``[0, capacity)``; callers keep offsets and sizes aligned.

    Not thread-safe on its own; its owners (SwapFile, Arena) call it under their locks.
    """

    __slots__ = ("capacity", "free_nbytes", "_by_start", "_by_end", "_by_size")

    def __init__(self, capacity: int) -> None:
        self.capacity: int = capacity
        self.free_nbytes: int = 0
        self._by_start: dict[int, int] = {}  # start -> size
        self._by_end: dict[int, int] = {}  # end -> start
        self._by_size: list[tuple[int, int]] = []  # sorted (size, start)
        self.reset(0)

    @property
    def largest_nbytes(self) -> int:
        """Size of the largest hole, 0 when the space is full."""
        return self._by_size[-1][0] if self._by_size else 0

    def holes(self) -> list[tuple[int, int]]:
        """``(start, size)`` of every hole in address order (for stats and tests)."""
        return sorted(self._by_start.items())

    def take(self, nbytes: int) -> int | None:
        """Carve ``nbytes`` from the start of the best-fitting hole; None when no hole fits."""
        i = bisect.bisect_left(self._by_size, (nbytes, -1))
        if i == len(self._by_size):
            return None
        size, start = self._by_size.pop(i)
        del self._by_start[start]
        del self._by_end[start + size]
        self.free_nbytes -= size
        if size > nbytes:
            self._add(start + nbytes, size - nbytes)
        return start

    def give(self, start: int, nbytes: int) -> None:
        """Return ``[start, start + nbytes)`` and merge it with the holes touching it."""
        end = start + nbytes
        before = self._by_end.get(start)
        if before is not None:
            self._remove(before)
            start = before
        after_size = self._by_start.get(end)
        if after_size is not None:
            self._remove(end)
            end += after_size
        self._add(start, end - start)

    def reset(self, used_nbytes: int) -> None:
        """Forget all holes: ``[0, used_nbytes)`` is taken and the rest is one hole."""
        self._by_start.clear()
        self._by_end.clear()
        self._by_size.clear()
        self.free_nbytes = 0
        if used_nbytes < self.capacity:
            self._add(used_nbytes, self.capacity - used_nbytes)

    def _add(self, start: int, size: int) -> None:
        self._by_start[start] = size
        self._by_end[start + size] = start
        bisect.insort(self._by_size, (size, start))
        self.free_nbytes += size

    def _remove(self, start: int) -> None:
        size = self._by_start.pop(start)
        del self._by_end[start + size]
        i = bisect.bisect_left(self._by_size, (size, start))
        del self._by_size[i]
        self.free_nbytes -= size
