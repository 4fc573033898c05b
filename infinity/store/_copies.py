"""Every key's entry, its copies on the tiers, and the moves that fill them.

Every method runs under the store's lock and never waits (see [Note: the store's lock] and
[Note: no waiting under the lock] in `_runner`): one that needs a running move to finish first
raises `MustWait` before it changes anything a rerun would redo. A copy's bytes follow
[Note: a copy's lifecycle] in `_entry`.

[Note: fetched tensors stay put] A tensor returned by a fetch is a view of an arena block. The
store never moves or evicts a copy that is in use (fetched, not yet released) or has I/O in
flight: compaction slides the other blocks around such copies (`Arena.compact(keep=...)`), so
the view stays valid until `release`. After release it must not be used again (the block may
move at the next compaction).
"""

from __future__ import annotations

import errno
import itertools
import logging
import threading
from typing import Any

import torch

import aio
from infinity.errors import BudgetError
from infinity.store._common import Tier
from infinity.store._entry import Copy, CopyState, Entry, PendingMove
from infinity.store._hints import UseClock
from infinity.store._runner import MustWait
from infinity.store._tiers import Tiers
from infinity.store.moves import MoveLog

logger = logging.getLogger("infinity.store.tensor_store")


class Copies:
    """The entries by key and the moves between their copies: fetching a copy to a tier,
    writing a changed value down to its home, evicting, settling finished moves."""

    def __init__(self, tiers: Tiers, clock: UseClock, log: MoveLog, device: torch.device, *,
                 checksum: bool) -> None:
        self.tiers = tiers
        self.clock = clock
        self.log = log
        self.checksum = checksum  # crc32c of every NVMe write, checked on every NVMe read
        self.entries: dict[str, Entry] = {}
        self.putting: dict[str, PendingMove] = {}  # put() writes to NVMe, settled by put() itself
        self.moving: set[PendingMove] = set()  # every other move started and not yet settled
        self._orders = itertools.count()
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._device = device

    # -- entries -------------------------------------------------------------------------------

    def new_entry(self, key: str, shape: torch.Size, dtype: torch.dtype) -> Entry:
        """The record of a key about to be stored (registered once its bytes have landed)."""
        return Entry(key, shape, dtype, shape.numel() * dtype.itemsize, next(self._orders))

    def entry(self, key: str) -> Entry:
        try:
            return self.entries[key]
        except KeyError:
            raise KeyError(f"no tensor {key!r} in the store") from None

    def check_new(self, key: str) -> None:
        if key in self.entries or key in self.putting:
            raise ValueError(f"key {key!r} is already in the store; drop() it first")

    def register(self, entry: Entry) -> None:
        self.entries[entry.key] = entry
        self.refresh(entry)

    def refresh(self, entry: Entry) -> None:
        """Bring the eviction queues up to date with a registered entry's copies (a copy being
        put or dropped is never a victim)."""
        if self.entries.get(entry.key) is entry:
            self.tiers.refresh(entry)

    def allocate(self, entry: Entry, tier: Tier) -> Copy:
        """An EMPTY copy on `tier`, evictable at once: a step that fails before filling it
        leaks nothing."""
        copy = self.tiers.allocate(entry, tier, self)
        self.refresh(entry)
        return copy

    # -- putting -------------------------------------------------------------------------------

    def put(self, entry: Entry, tier: Tier, source: torch.Tensor, source_tier: Tier,
            crc: int | None) -> PendingMove | None:
        """Place a new entry at home on `tier` with `source`'s bytes: copied at once on a memory
        tier (registered; returns None), or a write to NVMe that the caller waits for without
        the lock and hands to `finish_put`."""
        self.check_new(entry.key)
        copy = self.allocate(entry, tier)
        start = self.log.now()
        if tier != Tier.NVME:
            copy.block.tensor.copy_(source)
            copy.filled()
            self.log.record(entry.key, source_tier, tier, entry.nbytes, start, self.log.now())
            self.register(entry)
            return None
        try:
            request = self.tiers.write(copy.extent, source)
        except BaseException:
            self.tiers.free(entry, tier)
            raise
        move = PendingMove(entry, None, copy, start, request=request, src_tier=source_tier)
        copy.start_filling(move)
        copy.crc = crc
        self.putting[entry.key] = move
        return move

    def finish_put(self, entry: Entry, move: PendingMove) -> None:
        """The put's write is done: register the entry, or give its space back and raise."""
        self.putting.pop(entry.key, None)
        error = self.settle_move(move)
        if error is not None:
            self.tiers.free(entry, move.dst.tier)  # never registered: give its space back
            raise error
        self.register(entry)

    def reserve_chunks(self, entry: Entry, tier: Tier) -> Copy:
        """A copy for `put_chunks` to fill piece by piece, pinned (never a victim) meanwhile."""
        self.check_new(entry.key)
        copy = self.allocate(entry, tier)
        copy.pins += 1
        return copy

    def finish_chunks(self, entry: Entry, copy: Copy, crc: int | None, start: float) -> None:
        copy.pins -= 1
        copy.filled()
        copy.crc = crc
        self.log.record(entry.key, Tier.HOST, copy.tier, entry.nbytes, start, self.log.now())
        self.register(entry)

    def abandon_chunks(self, entry: Entry, copy: Copy, *, closed: bool) -> None:
        """`put_chunks` failed: nothing of the key stays (close() has freed it already)."""
        copy.pins -= 1
        if not closed:
            self.tiers.free(entry, copy.tier)

    # -- uses ----------------------------------------------------------------------------------

    def start_use(self, entry: Entry, tier: Tier, next_use: float | None, *,
                  overwrite: bool = False) -> None:
        """A fetch: the copy on `tier` is started (if need be) and held by this thread.
        overwrite: the holder writes every byte, so none is read in (`start_overwrite`)."""
        copy = self.start_overwrite(entry, tier) if overwrite else self.start_fetch(entry, tier)
        self.clock.fetched()
        self.clock.touch(copy)
        copy.holders.append(threading.get_ident())
        copy.prefetched = False
        if next_use is not None:
            self.clock.hint(entry, next_use)
        self.refresh(entry)

    def prefetch(self, entry: Entry, tier: Tier) -> None:
        with self.tiers.prefetch():
            copy = self.start_fetch(entry, tier)
        self.clock.touch(copy)
        copy.prefetched = copy.uses == 0
        self.refresh(entry)

    def end_use(self, entry: Entry, tier: Tier, *, dirty: bool) -> None:
        """A release. Dirty: the copy on `tier` holds the new value; faster copies go, slower
        ones are outdated (written down by `write_down`)."""
        copy = entry.copies.get(tier)
        if copy is None or copy.uses == 0:
            raise ValueError(f"release of {entry.key!r} on {tier.label} without a fetch")
        if dirty:
            for t, other in entry.copies.items():
                if t != tier and other.uses:
                    raise ValueError(f"{entry.key!r} was modified on {tier.label} while in use "
                                     f"on {t.label}")
            for other in list(entry.copies.values()):
                self.need_idle(other)
        me = threading.get_ident()
        copy.holders.remove(me if me in copy.holders else copy.holders[0])  # handed to this thread
        if dirty and copy.state is CopyState.EMPTY:
            self.refresh(entry)
            self.tiers.room.changed()
            raise ValueError(f"release(dirty=True) of {entry.key!r} on {tier.label}: its bytes "
                             f"never arrived (the fetch failed), so nothing was written; the "
                             f"fetch is released")
        if dirty:
            for t in [t for t in entry.copies if t < tier]:
                self.tiers.free(entry, t)
            for t in [t for t in entry.copies if t > tier]:
                entry.copies[t].outdate()
        self.refresh(entry)
        self.tiers.room.changed()

    def pin(self, entry: Entry, tier: Tier) -> None:
        copy = self.start_fetch(entry, tier)
        self.clock.touch(copy)
        copy.pins += 1
        self.refresh(entry)

    def unpin(self, entry: Entry, tier: Tier) -> None:
        copy = entry.copies.get(tier)
        if copy is None or copy.pins == 0:
            raise ValueError(f"unpin of {entry.key!r} on {tier.label} that is not pinned")
        copy.pins -= 1
        self.refresh(entry)
        self.tiers.room.changed()

    def evict_idle(self, entry: Entry, tier: Tier) -> None:
        """A caller's evict: the copy must be neither in use nor pinned."""
        copy = entry.copies.get(tier)
        if copy is None:
            return
        if copy.uses or copy.pins:
            raise ValueError(f"cannot evict {entry.key!r} from {tier.label}: it is in use "
                             f"({copy.uses} fetches not released) or pinned ({copy.pins} pins)")
        self.evict(entry, tier)

    def drop(self, entry: Entry) -> None:
        in_use = [t.label for t, c in entry.copies.items() if c.uses]
        if in_use:
            raise ValueError(f"cannot drop {entry.key!r}: it is in use on {', '.join(in_use)} "
                             f"(fetched, not released)")
        for copy in list(entry.copies.values()):
            self.need_idle(copy, quiet=True)  # its bytes are discarded: a failed move is logged
        for tier in list(entry.copies):
            self.tiers.free(entry, tier)
        if entry.kept is not None:
            self.tiers.free_kept(entry.kept)
            entry.kept = None
        del self.entries[entry.key]

    # -- moves ---------------------------------------------------------------------------------

    def start_fetch(self, entry: Entry, tier: Tier) -> Copy:
        """Make sure a current copy on `tier` exists (filled or being filled); idempotent."""
        copy = entry.copies.get(tier)
        if copy is not None and copy.current:
            return copy
        source = entry.source_for(tier)
        if source is None:
            raise RuntimeError(f"{entry.key!r} has no valid copy (a write-back failed earlier?)")
        if tier == Tier.DEVICE and source.tier == Tier.NVME and Tier.HOST in self.tiers.arenas:
            # Staged through host; the device copy is made at result().
            self.start_fetch(entry, Tier.HOST)
            return copy or self.allocate(entry, tier)
        copy = copy or self.allocate(entry, tier)
        self.fill(entry, copy, entry.source_for(tier))  # making room may have evicted `source`
        return copy

    def start_overwrite(self, entry: Entry, tier: Tier) -> Copy:
        """A copy on `tier` whose holder will write every byte: a current one as it is, else one
        made current with undefined bytes and no read (the holder releases it dirty). Nobody
        else may hold the entry meanwhile: they would see the undefined bytes."""
        in_use = [t.label for t, c in entry.copies.items() if c.uses]
        if in_use:
            raise ValueError(f"cannot overwrite {entry.key!r}: it is in use on "
                             f"{', '.join(in_use)} (fetched, not released)")
        copy = entry.copies.get(tier)
        if copy is not None and copy.current:
            return copy
        copy = copy or self.allocate(entry, tier)
        copy.filled()  # no move touches an EMPTY copy: nothing to wait for
        return copy

    def fetched_tensor(self, entry: Entry, tier: Tier, *, reads_only: bool = False
                       ) -> torch.Tensor:
        """The fetched copy's tensor once its bytes have landed (a failed read is retried, a
        device copy staged through host is made once the host copy has landed); `reads_only`:
        also while the copy is DRAINING (its move out reads the bytes too)."""
        if entry.copies.get(tier) is None:
            raise RuntimeError(f"{entry.key!r} left {tier.label} before its fetch completed")
        copy = self.start_fetch(entry, tier)
        if not copy.current:  # staged: the host copy (started again if it was evicted) lands first
            self.fill(entry, copy, self.start_fetch(entry, Tier.HOST))
        if not (reads_only and copy.state is CopyState.DRAINING):  # a move out only reads it
            self.need_idle(copy)
        return copy.block.tensor

    def ready(self, entry: Entry, tier: Tier, *, reads_only: bool = False) -> bool:
        """Whether `fetched_tensor` would not wait (its bytes landed, or their move failed)."""
        copy = entry.copies.get(tier)
        return (copy is not None and copy.current
                and (copy.moves_done() or reads_only and copy.state is CopyState.DRAINING))

    def fill(self, entry: Entry, dst: Copy, src: Copy) -> None:
        """Start copying src's bytes into dst: both must be idle (src's bytes landed, earlier
        writes into dst done, so writes to one place stay ordered)."""
        if not src.current or entry.copies.get(src.tier) is not src:
            raise RuntimeError(f"{entry.key!r}: a move from a copy that is gone or stale "
                               f"({src.tier.label})")
        self.need_idle(src)
        self.need_idle(dst)
        start = self.log.now()
        if src.tier == Tier.NVME:
            move = PendingMove(entry, src, dst, start,
                               request=self.tiers.read(src.extent, dst.block.tensor))
        elif dst.tier == Tier.NVME:
            if entry.kept is not None:  # the kept extent is never written
                entry.kept.redirect(dst)
            dst.crc = aio.crc32c(src.block.tensor) if self.checksum else None
            move = PendingMove(entry, src, dst, start,
                               request=self.tiers.write(dst.extent, src.block.tensor))
        else:
            move = PendingMove(entry, src, dst, start,
                               event=self.device_copy(dst.block.tensor, src.block.tensor))
        if move.event is None and move.request is None:
            dst.filled()  # a synchronous copy: already done
            move.finish(self.log)
        else:  # the source must not be freed or changed until the bytes are out of it
            dst.start_filling(move)
            src.start_draining(move)
            self.moving.add(move)
        self.refresh(entry)

    def device_copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Copy between host and device tiers; on CUDA on the side stream, returning its event."""
        if self.copy_stream is None:
            dst.copy_(src)
            return None
        # The side stream must see what the caller's stream did to src (e.g. the update before a
        # dirty release) before it reads it.
        self.copy_stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(self.copy_stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        return event

    def write_down(self, entry: Entry) -> None:
        """Refresh every outdated slower copy from the fastest current one; idempotent."""
        if self.entries.get(entry.key) is not entry:
            return
        src = next((c for _, c in sorted(entry.copies.items()) if c.current), None)
        if src is None:
            return
        if src.tier == Tier.DEVICE and self.copy_stream is not None \
                and Tier.NVME in entry.copies and Tier.HOST not in entry.copies:
            self.allocate(entry, Tier.HOST)  # accelerator memory reaches NVMe through the host
        for tier in sorted(t for t in entry.copies if t > src.tier):
            dst = entry.copies[tier]
            if not dst.current:
                self.fill(entry, dst, src)
            src = dst

    def evicts_now(self, entry: Entry, tier: Tier) -> bool:
        """Whether `evict` drops the copy at once: no move on it, nothing to write down (a
        write-down counts as a wait even where it is a synchronous copy)."""
        return entry.copies[tier].moves_done() and not _last_current(entry, tier)

    def evict(self, entry: Entry, tier: Tier) -> None:
        """Drop entry's copy on `tier`; the last current copy is first written down a tier."""
        copy = entry.copies[tier]
        self.need_idle(copy)
        if _last_current(entry, tier):
            below = self.tiers.below(tier)
            if below is None:
                raise BudgetError(f"cannot evict {entry.key!r} from {tier.label}: no slower tier "
                                  f"to move it to")
            try:
                dst = entry.copies.get(below) or self.allocate(entry, below)
            except BudgetError as exc:
                raise BudgetError(f"cannot evict {entry.key!r} from {tier.label}: {exc}") from None
            self.fill(entry, dst, copy)
            if dst.busy:
                raise MustWait(dst.move)  # freed at the rerun, once the bytes are down
        self.tiers.free(entry, tier)

    # -- settling ------------------------------------------------------------------------------

    def moves_in_flight(self) -> set[PendingMove]:
        return self.moving

    def need_idle(self, copy: Copy, *, quiet: bool = False) -> None:
        """Settle the finished move of `copy`; MustWait for one still running."""
        move = copy.move
        if move is not None:
            if not move.done():
                raise MustWait(move, quiet=quiet)
            self.settle(move, quiet)

    def settle(self, move: PendingMove, quiet: bool = False) -> None:
        """Record a finished move; a failure is raised (or, quiet, logged). Once per move."""
        error = self.settle_move(move)
        if error is None:
            return
        if not quiet:
            raise error
        logger.warning("%s: %s", error, "; ".join(getattr(error, "__notes__", [])))

    def settle_move(self, move: PendingMove) -> aio.AIOError | None:
        """Clear a finished move from its copies and return its error, if any. A failed move
        leaves its destination EMPTY; the source keeps the bytes, so nothing is lost."""
        if move.settled:
            return None
        move.settled = True
        self.moving.discard(move)
        error = None
        try:
            move.wait(0)
        except aio.AIOError as exc:
            error = exc
            exc.add_note(f"store: moving {move.entry.key!r} {move.src_tier.label} -> "
                         f"{move.dst.tier.label}")
        if error is None and move.src is not None and move.src.crc is not None:
            error = self._verify(move)  # a mismatch is a failed read: the copy is not valid
        move.dst.settle(move, landed=error is None)
        if move.src is not None:
            move.src.settle(move, landed=True)
        if error is None:
            move.finish(self.log)
        self.refresh(move.entry)
        return error

    def settle_finished(self) -> None:
        """Settle every move that has finished (the moves in flight, not the whole store)."""
        for move in [m for m in self.moving if m.done()]:
            self.settle(move)

    def settle_all(self, moves: list[PendingMove]) -> list[aio.AIOError]:
        """The store is closing and every move has finished: settle them, forget every entry;
        returns the moves' errors."""
        errors = [e for e in map(self.settle_move, moves) if e is not None]
        self.entries.clear()
        self.tiers.forget_all()
        return errors

    def _verify(self, move: PendingMove) -> aio.AIOError | None:
        """Compare the bytes read from NVMe with the crc32c recorded when they were written."""
        found = aio.crc32c(move.dst.block.tensor)
        if found == move.src.crc:
            return None
        error = aio.AIOError(
            errno.EIO, f"checksum mismatch reading {move.entry.key!r}: crc32c {found:#010x}, "
            f"written {move.src.crc:#010x} (the swap file was changed behind the store)",
            self.tiers.swap.name, op="verify", offset=move.src.extent.offset,
            nbytes=move.entry.nbytes)
        error.add_note(f"store: moving {move.entry.key!r} nvme -> {move.dst.tier.label}")
        return error

    # -- what a key holds ------------------------------------------------------------------------

    def unsaved(self, entry: Entry) -> bool:
        """Whether a slower copy lacks changes a faster one holds (their write-back failed)."""
        copies = sorted(entry.copies.items())
        return any(c.current and any(s.state is CopyState.EMPTY for t, s in copies if t > tier)
                   for tier, c in copies)

    def current_tiers(self, entry: Entry) -> list[Tier]:
        """Tiers holding (or being filled with) the current value, fastest first."""
        return [t for t, c in sorted(entry.copies.items()) if c.current]


def _last_current(entry: Entry, tier: Tier) -> bool:
    """Whether entry's copy on `tier` holds the current value and no slower copy does."""
    return entry.copies[tier].current and entry.current_below(tier) is None
