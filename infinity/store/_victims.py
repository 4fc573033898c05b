"""Which copy a full tier evicts: a heap keyed by eviction priority, O(log n) per change.

[Note: eviction order] Among the evictable copies of a tier (not in use, not pinned, with a
slower tier to go to), the victim is, in order of precedence:
1. one not brought in by a prefetch that is still unused (evicting a prefetched copy wastes
   its read, and it is needed soon);
2. the one needed farthest in the future (next-use hints; no hint = never);
3. an idle one before one with a move still running (evicting that would wait for its I/O);
4. the least recently used;
5. the oldest entry.
"""

from __future__ import annotations

import heapq

from infinity.store._entry import Copy, Entry

# (prefetched, -next_use, busy, last_use), entry order, push sequence, entry, copy
_Item = tuple[tuple[bool, float, bool, int], int, int, Entry, Copy]


def priority(entry: Entry, copy: Copy) -> tuple[bool, float, bool, int]:
    """Smaller is evicted first; see [Note: eviction order]."""
    return (copy.prefetched, -entry.next_use, copy.busy, copy.last_use)


class VictimQueue:
    """The evictable copies of one tier, smallest priority on top.

    Stale heap items are invalidated lazily: each copy has at most one live item (`_live`),
    and an item popped that is not the live one of its copy is dropped. The caller calls
    `update` after any change to a copy's priority or evictability and `discard` when the
    copy is freed.
    """

    def __init__(self) -> None:
        self._heap: list[_Item] = []
        self._live: dict[int, _Item] = {}  # id(copy) -> its current item
        self._pushes = 0

    def __len__(self) -> int:
        return len(self._live)

    def update(self, entry: Entry, copy: Copy) -> None:
        if not copy.evictable:
            self.discard(copy)
            return
        key = priority(entry, copy)
        item = self._live.get(id(copy))
        if item is not None and item[0] == key:
            return
        self._pushes += 1
        item = (key, entry.order, self._pushes, entry, copy)
        self._live[id(copy)] = item
        heapq.heappush(self._heap, item)
        if len(self._heap) > 4 * len(self._live) + 64:  # mostly stale: rebuild from the live ones
            self._heap = list(self._live.values())
            heapq.heapify(self._heap)

    def discard(self, copy: Copy) -> None:
        self._live.pop(id(copy), None)

    def clear(self) -> None:
        self._heap.clear()
        self._live.clear()

    def _top(self) -> _Item | None:
        while self._heap:
            item = self._heap[0]
            if self._live.get(id(item[4])) is item:
                return item
            heapq.heappop(self._heap)
        return None

    def pick(self) -> Entry | None:
        """The entry whose copy should be evicted next, or None when there is none.

        "Busy" is read from the copies as recorded: the caller settles the moves that have
        finished before asking, so that such a copy counts as idle (rule 3).
        """
        top = self._top()
        return None if top is None else top[3]
