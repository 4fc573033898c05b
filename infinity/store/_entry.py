"""The store's records: one entry per key, one copy per tier it is present on, and pending moves."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from aio import AIOError, AIOTimeoutError, Extent, Request
from infinity.memory import Block
from infinity.store._common import Tier
from infinity.store.moves import MoveLog


class PendingMove:
    """A transfer into one copy (`dst`, from `src`) that has started and is not yet settled.

    `wait` blocks and must run without the store lock; settling (recording the move, clearing
    it from its copies) runs under the lock, exactly once (`settled`).
    """

    __slots__ = ("entry", "src", "src_tier", "dst", "start", "request", "event", "settled")

    def __init__(self, entry: Entry, src: Copy | None, dst: Copy, start: float, *,
                 request: Request | None = None, event: Any = None, src_tier: Tier | None = None) -> None:
        self.entry = entry
        self.src = src  # None for a put: the bytes come from the caller's tensor
        self.src_tier = src.tier if src is not None else src_tier
        self.dst = dst
        self.start = start
        self.request = request  # an aio request (host <-> nvme)
        self.event = event  # a CUDA event (host <-> device on a side stream)
        self.settled = False

    def wait(self, timeout: float | None = None) -> None:
        """Block until the bytes have landed; raises the transfer's AIOError."""
        if self.request is not None:
            self.request.wait(timeout)
        if self.event is not None:
            self.event.synchronize()

    def wait_quietly(self, timeout: float | None = None) -> None:
        """Block until done, success or failure (the failure is raised when it is settled);
        only AIOTimeoutError comes out."""
        try:
            self.wait(timeout)
        except AIOTimeoutError:
            raise
        except AIOError:
            pass

    def done(self) -> bool:
        if self.request is not None and not self.request.done():
            return False
        return self.event is None or self.event.query()

    def finish(self, log: MoveLog) -> None:
        log.record(self.entry.key, self.src_tier, self.dst.tier, self.entry.nbytes, self.start, log.now())

    def __repr__(self) -> str:
        return f"<move {self.entry.key!r} {self.src_tier.label} -> {self.dst.tier.label}>"


@dataclass(slots=True, eq=False)
class Copy:
    """A tensor's bytes on one tier."""

    tier: Tier
    block: Block | None = None  # DEVICE and HOST: arena block
    extent: Extent | None = None  # NVME: swap file extent
    valid: bool = False  # holds the current value (once `filling` lands)
    filling: PendingMove | None = None  # bytes on their way into this copy
    draining: PendingMove | None = None  # a move out of it: it must stay unchanged
    holders: list[int] = field(default_factory=list)  # thread of each use (threading.get_ident)
    pins: int = 0  # pin() calls not yet unpinned: never evicted
    last_use: int = 0  # store's touch counter at the last fetch, prefetch or pin: for LRU
    prefetched: bool = False  # brought in by prefetch() and not fetched since: needed soon
    crc: int | None = None  # NVME with checksums on: crc32c of the bytes last written into it

    @property
    def uses(self) -> int:
        """Fetches not yet released (one holder each): neither evicted nor moved meanwhile."""
        return len(self.holders)

    @property
    def busy(self) -> bool:
        """A move into or out of this copy has not been settled yet (it may have finished)."""
        return self.filling is not None or self.draining is not None

    def moves_done(self) -> bool:
        """No move into or out of this copy is still running (settled or not)."""
        return all(m is None or m.done() for m in (self.filling, self.draining))

    @property
    def evictable(self) -> bool:
        return self.uses == 0 and self.pins == 0


@dataclass(slots=True, eq=False)
class Entry:
    """Everything the store knows about one key."""

    key: str
    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    order: int  # creation order: the last tie-break among eviction candidates
    copies: dict[Tier, Copy] = field(default_factory=dict)
    next_use: float = math.inf  # store clock when it is needed next (farthest is evicted first)

    @property
    def home(self) -> Tier:
        """The slowest tier holding a copy: that copy is never dropped, only moved down."""
        return max(self.copies)

    def valid_source(self, tier: Tier) -> Copy | None:
        """Where a copy on `tier` gets its bytes: the nearest valid slower copy, else the
        nearest valid faster one (right after a dirty release, before its write-back starts,
        only the modified copy is valid)."""
        below = self.valid_below(tier)
        if below is not None:
            return below
        return next((self.copies[t] for t in sorted(self.copies, reverse=True) if t < tier and self.copies[t].valid),
                    None)

    def valid_below(self, tier: Tier) -> Copy | None:
        """The nearest valid copy on a slower tier than `tier`."""
        for t in sorted(self.copies):
            if t > tier and self.copies[t].valid:
                return self.copies[t]
        return None
