"""The store's clocks: fetches (the unit of next-use hints) and touches (the unit of LRU)."""

from __future__ import annotations

import math

from infinity.store._entry import Copy, Entry


class UseClock:
    """One clock for every caller's next-use hints (optimizer, prefetcher): `set_next_use({k:
    d})` and `fetch(k, next_use=d)` mean "needed again at the d-th fetch from now"."""

    def __init__(self) -> None:
        self.fetches = 0  # fetches so far: the unit of next-use hints
        self.touches = 0  # fetches, prefetches and pins so far: the unit of LRU

    def fetched(self) -> None:
        self.fetches += 1

    def touch(self, copy: Copy) -> None:
        self.touches += 1
        copy.last_use = self.touches

    def hint(self, entry: Entry, distance: float) -> None:
        """`entry` is needed at the `distance`-th fetch from now."""
        entry.next_use = self.fetches + distance

    def fetches_until(self, entry: Entry) -> float:
        """Fetches from now until the entry's next use (inf: no hint)."""
        return entry.next_use - self.fetches


def check_distance(key: str, distance: float) -> None:
    if not isinstance(distance, (int, float)) or math.isnan(distance):
        raise ValueError(f"next-use hint for {key!r} must be a number (a distance in fetches), "
                         f"got {distance!r}")
