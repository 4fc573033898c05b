"""The store's records: one entry per key, one copy per tier it is present on, and pending moves."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from aio import Extent, Request
from infinity.memory import Block
from infinity.store._common import Tier
from infinity.store.moves import MoveLog


class PendingMove:
    """A transfer into one copy that has been started and not yet observed complete.

    `wait` blocks without the store lock; `finish` records the move and runs under it.
    """

    __slots__ = ("key", "src", "dst", "nbytes", "start", "request", "event")

    def __init__(self, key: str, src: Tier, dst: Tier, nbytes: int, start: float,
                 request: Request | None = None, event: Any = None) -> None:
        self.key = key
        self.src = src
        self.dst = dst
        self.nbytes = nbytes
        self.start = start
        self.request = request  # an aio request (host <-> nvme)
        self.event = event  # a CUDA event (host <-> device on a side stream)

    def wait(self, timeout: float | None = None) -> None:
        """Block until the bytes have landed; raises the transfer's AIOError."""
        if self.request is not None:
            self.request.wait(timeout)
        if self.event is not None:
            self.event.synchronize()

    def done(self) -> bool:
        if self.request is not None and not self.request.done():
            return False
        return self.event is None or self.event.query()

    def finish(self, log: MoveLog) -> None:
        log.record(self.key, self.src, self.dst, self.nbytes, self.start, log.now())


@dataclass(slots=True)
class Copy:
    """A tensor's bytes on one tier."""

    tier: Tier
    block: Block | None = None  # DEVICE and HOST: arena block
    extent: Extent | None = None  # NVME: swap file extent
    valid: bool = False  # holds the current value (once `filling` lands)
    filling: PendingMove | None = None  # bytes on their way into this copy
    draining: PendingMove | None = None  # a write-back out of it: it must stay unchanged
    uses: int = 0  # fetches not yet released: neither evicted nor moved meanwhile
    pins: int = 0  # pin() calls not yet unpinned: never evicted
    last_use: int = 0  # store clock at the last fetch, for LRU
    prefetched: bool = False  # brought in by prefetch() and not fetched since: needed soon

    @property
    def busy(self) -> bool:
        return self.filling is not None or self.draining is not None

    def moves_done(self) -> bool:
        """No move into or out of this copy is still running (recorded or not)."""
        return all(m is None or m.done() for m in (self.filling, self.draining))

    @property
    def evictable(self) -> bool:
        return self.uses == 0 and self.pins == 0


@dataclass(slots=True)
class Entry:
    """Everything the store knows about one key."""

    key: str
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    home: Tier  # the lowest tier holding it: the copy that is never dropped, only moved down
    copies: dict[Tier, Copy] = field(default_factory=dict)
    next_use: float = math.inf  # caller's hint: when it is needed next (farthest is evicted first)

    def valid_below(self, tier: Tier) -> Copy | None:
        """The nearest valid copy on a slower tier than `tier`."""
        for t in sorted(self.copies):
            if t > tier and self.copies[t].valid:
                return self.copies[t]
        return None
