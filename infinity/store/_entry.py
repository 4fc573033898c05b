"""The store's records: one entry per key, one copy per tier it is present on, and pending moves.

[Note: a copy's lifecycle] What a copy's bytes are is one `CopyState`, changed only through the
methods below, which check the transition (a wrong one is a bug in the store, named):

    EMPTY --a move in starts--> FILLING --settled, landed--> VALID
                                        --settled, failed--> EMPTY
    EMPTY --bytes copied at once (a memory copy, a put)--> VALID
    VALID --a move out starts--> DRAINING --settled--> VALID
    VALID --a faster copy was changed (dirty release)--> EMPTY
    EMPTY or VALID --a kept version restored (rollback)--> VALID

A move starts only between two idle copies (EMPTY or VALID), so a copy has at most one move
running (`move`), in or out. A copy counts as the current value (`current`) from the start of
its fill: a fetch may hand out a FILLING copy, whose bytes are used only once the fill has been
settled. The uses of a copy (`holders`, `pins`, `prefetched`) are apart from its bytes' state:
a fetch holds a copy whatever its state, and no copy in use or pinned is evicted or moved.
"""

from __future__ import annotations

import enum
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
                 request: Request | None = None, event: Any = None,
                 src_tier: Tier | None = None) -> None:
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
        log.record(self.entry.key, self.src_tier, self.dst.tier, self.entry.nbytes, self.start,
                   log.now())

    def __repr__(self) -> str:
        return f"<move {self.entry.key!r} {self.src_tier.label} -> {self.dst.tier.label}>"


class CopyState(enum.Enum):
    """What a copy's bytes are; see [Note: a copy's lifecycle]."""

    EMPTY = "empty"  # not the current value: new, a failed fill, or outdated by a faster copy
    FILLING = "filling"  # the current value is on its way in (`move`)
    VALID = "valid"  # holds the current value; no move touches it
    DRAINING = "draining"  # holds the current value, a move out of it runs (`move`): unchanged


@dataclass(slots=True, eq=False)
class Copy:
    """A tensor's bytes on one tier."""

    tier: Tier
    block: Block | None = None  # DEVICE and HOST: arena block
    extent: Extent | None = None  # NVME: swap file extent
    state: CopyState = CopyState.EMPTY  # changed by the methods below only
    move: PendingMove | None = None  # the move into (FILLING) or out of (DRAINING) this copy
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
    def current(self) -> bool:
        """Holds the current value, or it is on its way in."""
        return self.state is not CopyState.EMPTY

    @property
    def busy(self) -> bool:
        """A move into or out of this copy has not been settled yet (it may have finished)."""
        return self.move is not None

    def moves_done(self) -> bool:
        """No move into or out of this copy is still running (settled or not)."""
        return self.move is None or self.move.done()

    @property
    def evictable(self) -> bool:
        return self.uses == 0 and self.pins == 0

    # -- transitions; see [Note: a copy's lifecycle] ----------------------------------------------

    def expect(self, *states: CopyState) -> None:
        """Raise if the copy is not in one of `states` (a wrong transition is a bug, say which)."""
        if self.state not in states:
            raise RuntimeError(f"store: the {self.tier.label} copy is {self.state.value}, expected "
                               f"{' or '.join(s.value for s in states)}")

    def filled(self) -> None:
        """The current value was copied in at once."""
        self.expect(CopyState.EMPTY)
        self.state = CopyState.VALID

    def start_filling(self, move: PendingMove) -> None:
        self.expect(CopyState.EMPTY)
        self.state, self.move = CopyState.FILLING, move

    def start_draining(self, move: PendingMove) -> None:
        self.expect(CopyState.VALID)
        self.state, self.move = CopyState.DRAINING, move

    def settle(self, move: PendingMove, *, landed: bool) -> None:
        """`move`, into or out of this copy, is over: a fill that did not land leaves it EMPTY."""
        if self.move is not move:
            raise RuntimeError(f"store: settling {move!r}, which does not touch the "
                               f"{self.tier.label} copy")
        self.expect(CopyState.FILLING, CopyState.DRAINING)
        filling = self.state is CopyState.FILLING
        self.state = CopyState.EMPTY if filling and not landed else CopyState.VALID
        self.move = None

    def outdate(self) -> None:
        """A faster copy holds a newer value: these bytes are no longer the current value."""
        self.expect(CopyState.VALID, CopyState.EMPTY)
        self.state = CopyState.EMPTY

    def restore(self, crc: int | None) -> None:
        """Its bytes are a kept version made current again (a rollback; see [Note: kept
        versions] in `_kept`), whose crc32c was `crc`."""
        self.expect(CopyState.EMPTY, CopyState.VALID)
        self.state, self.crc = CopyState.VALID, crc


@dataclass(slots=True, eq=False)
class Kept:
    """An entry's bytes as they were at `TensorStore.keep`, held until a commit or a rollback;
    see [Note: kept versions] in `_kept`."""

    tier: Tier  # the entry's home when it was kept
    block: Block | None = None  # a memory home: a copy of the home block, taken at keep
    extent: Extent | None = None  # NVMe: the home copy's extent at keep, never written again
    crc: int | None = None  # NVMe with checksums on: the crc32c of `extent`'s bytes
    shadow: Extent | None = None  # NVMe: reserved at keep for the home copy's next write; None
    # once that write took it (until then the home copy's extent is `extent`)

    def redirect(self, copy: Copy) -> None:
        """A write into `copy` is about to start: the home copy's first one after keep goes to
        the shadow extent, so the kept extent's bytes stay as they were."""
        if self.shadow is not None and copy.tier is self.tier:
            copy.extent, self.shadow = self.shadow, None


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
    kept: Kept | None = None  # the bytes `TensorStore.keep` holds until commit or rollback

    @property
    def home(self) -> Tier:
        """The slowest tier holding a copy: that copy is never dropped, only moved down."""
        return max(self.copies)

    def source_for(self, tier: Tier) -> Copy | None:
        """Where a copy on `tier` gets its bytes: the nearest current slower copy, else the
        nearest current faster one (right after a dirty release, before its write-back starts,
        only the modified copy is current)."""
        below = self.current_below(tier)
        if below is not None:
            return below
        return next((self.copies[t] for t in sorted(self.copies, reverse=True)
                     if t < tier and self.copies[t].current), None)

    def current_below(self, tier: Tier) -> Copy | None:
        """The nearest current copy on a slower tier than `tier`."""
        for t in sorted(self.copies):
            if t > tier and self.copies[t].current:
                return self.copies[t]
        return None
