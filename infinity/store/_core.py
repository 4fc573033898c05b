"""The store's machinery under its lock: space on each tier, eviction, moves and their settling.

[Note: fetched tensors stay put] A tensor returned by a fetch is a view of an arena block. The
store never moves or evicts a copy that is in use (fetched, not yet released) or has I/O in
flight: compaction slides the other blocks around such copies (`Arena.compact(keep=...)`), so
the view stays valid until `release`. After release it must not be used again (the block may
move at the next compaction).

[Note: no waiting under the lock] Every step here runs under the store's lock and never
blocks on I/O (or on a CUDA copy). A step that needs a move to finish first (a write-back
before its source may be freed, a read before its bytes may be used) raises `_MustWait`
before it changes anything a rerun would redo; `_run` then waits for that move without the
lock, settles it under the lock, and runs the step again. So a thread waiting for a slow
write-back never stalls another thread's fetch of a resident tensor.

[Note: room on a fragmented tier] A copy in use stays put, but nothing else does: when a
tier's free bytes would hold a request but no hole does, the arena compacts around the copies
in use and those with I/O in flight (`Arena.compact(keep=...)`), before evicting anything,
unless the copy next in line to go is needed further away (in fetches) than the tier has
evictable copies: the tier turns over before that use, so evicting it now costs no read that
keeping it would save, and a compaction would move every block for nothing (measured on the
294M GPT with everything on NVMe: a 566 MB host tier compacted ~200 times a step, moving
~8.7 GB, over 1 s of CPU per step).
When even evicting every candidate leaves no hole, the step waits without the lock (`_run`),
first for I/O in flight on the tier, then, bounded by `room_wait_s` per call, for a use that
another thread may end (`_MustWaitForRoom`), and runs again. It waits only while a release
could help: some copy in use is held only by threads that are not themselves waiting for room,
and the copies held by this thread and by the waiting threads leave a gap large enough. Else
(every holder waits, so waiting would deadlock; the copies this thread holds are in the way;
the tier is too small) it raises BudgetError at once, naming the bytes needed, free, the
largest hole, and those in use.
"""

from __future__ import annotations

import errno
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

import aio
from aio.buffers import PAGE_NBYTES
from infinity.errors import BudgetError
from infinity.memory import Arena, Block
from infinity.store._common import Tier
from infinity.store._entry import Copy, Entry, PendingMove
from infinity.store._victims import VictimQueue
from infinity.store.moves import MoveLog

logger = logging.getLogger("infinity.store.tensor_store")

T = TypeVar("T")


class _MustWait(Exception):
    """A step needs `move` to finish first; see [Note: no waiting under the lock]."""

    def __init__(self, move: PendingMove, *, quiet: bool = False) -> None:
        super().__init__(move)
        self.move = move
        self.quiet = quiet  # a failure of the move is logged, not raised (its bytes are discarded)


class _MustWaitForRoom(Exception):
    """A step needs room that a use held by another thread may free; see [Note: room on a
    fragmented tier]. The calling thread is registered as waiting for room."""

    def __init__(self, seen: int, deadline: float) -> None:
        super().__init__(seen)
        self.seen = seen  # the room counter when the step gave up: wait for it to change
        self.deadline = deadline  # monotonic time after which the step raises BudgetError


class _CallState(threading.local):
    """Per thread, per `_run` call: when its waits for room end (None: it has not waited)."""

    room_deadline: float | None = None
    room_waited_from: float = 0.0


class StoreCore:
    """State and internal steps of TensorStore; every `_` method but `_run` runs under `_lock`."""

    def __init__(self, budgets: dict[Tier, int], device: torch.device, handle: aio.Handle | None,
                 own_handle: bool, keep_timeline: bool, checksum: bool, room_wait_s: float) -> None:
        self.budgets = budgets
        self.device = device
        self.checksum = checksum  # crc32c of every NVMe write, checked on every NVMe read
        self.moves = MoveLog(keep_timeline=keep_timeline)
        self._lock = threading.RLock()
        self._closed = False
        self._entries: dict[str, Entry] = {}
        self._putting: dict[str, PendingMove] = {}  # put() writes to NVMe, settled by put() itself
        self._moving: set[PendingMove] = set()  # every other move started and not yet settled
        self._orders = itertools.count()
        self._clock = 0  # fetches so far: the unit of next-use hints
        self._touches = 0  # fetches, prefetches and pins so far: the unit of LRU
        self._prefetching = False  # a prefetch may not evict copies prefetched before it
        self._arenas: dict[Tier, Arena] = {}
        self._victims: dict[Tier, VictimQueue] = {}
        self.room_wait_s = room_wait_s  # longest wait of one call for another thread's release
        self._room = threading.Condition(threading.Lock())  # notified when room may have appeared
        self._room_changes = 0  # releases, frees, unpins and new waiters so far
        self._waiting_for_room: set[int] = set()  # threads (get_ident) in a wait for room
        self._call = _CallState()
        self._room_waits = 0  # waits for another thread's release, and their seconds
        self._room_wait_total_s = 0.0
        self._swap: aio.SwapFile | None = None
        self._handle = handle
        self._own_handle = own_handle
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _open_arenas(self) -> None:
        # Host blocks start on pages so aio moves them with O_DIRECT, never through the cache.
        if self.budgets.get(Tier.DEVICE):
            self._arenas[Tier.DEVICE] = Arena(self.budgets[Tier.DEVICE], self.device,
                                              alignment=PAGE_NBYTES if self.device.type == "cpu" else 256)
        if self.budgets.get(Tier.HOST):
            self._arenas[Tier.HOST] = Arena(self.budgets[Tier.HOST], "cpu", pinned=torch.cuda.is_available(),
                                            alignment=PAGE_NBYTES)
        for tier in self._arenas:
            if self._tier_below(tier) is not None:  # the bottom tier never evicts
                self._victims[tier] = VictimQueue()

    # -- running steps -------------------------------------------------------------------------

    def _run(self, step: Callable[[], T], timeout: float | None = None) -> T:
        """Run `step` under the lock; see [Note: no waiting under the lock]."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._call.room_deadline = None
        while True:
            room = None
            with self._lock:
                self._check_open()
                try:
                    return step()
                except _MustWait as wait:
                    move, quiet = wait.move, wait.quiet
                except _MustWaitForRoom as wait:
                    room = wait
            if room is not None:
                self._wait_for_room(room, deadline)
                continue
            move.wait_quietly(None if deadline is None else max(0.0, deadline - time.monotonic()))
            with self._lock:
                self._settle(move, quiet=quiet)

    def _wait_for_room(self, wait: _MustWaitForRoom, deadline: float | None) -> None:
        """Wait (no store lock) until room may have appeared or the call's wait ends."""
        end = wait.deadline if deadline is None else min(wait.deadline, deadline)
        if deadline is not None and deadline < wait.deadline:
            self._call.room_deadline = end  # the caller's timeout ends the wait for room too
        start = time.monotonic()
        try:
            with self._room:
                while self._room_changes == wait.seen:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._room.wait(left)
        finally:
            with self._lock:
                self._waiting_for_room.discard(threading.get_ident())
                self._room_waits += 1
                self._room_wait_total_s += time.monotonic() - start

    def _room_changed(self) -> None:
        """Wake the threads waiting for room: they run their step again."""
        with self._room:
            self._room_changes += 1
            self._room.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("the TensorStore is closed")

    def _need_idle(self, copy: Copy, *, quiet: bool = False) -> None:
        """Settle the finished moves of `copy`; _MustWait for one still running."""
        for move in (copy.filling, copy.draining):
            if move is not None:
                if not move.done():
                    raise _MustWait(move, quiet=quiet)
                self._settle(move, quiet=quiet)

    def _settle(self, move: PendingMove, *, quiet: bool = False) -> None:
        """Record a finished move; a failure is raised (or, quiet, logged). Once per move."""
        error = self._settle_move(move)
        if error is None:
            return
        if not quiet:
            raise error
        logger.warning("%s: %s", error, "; ".join(getattr(error, "__notes__", [])))

    def _settle_move(self, move: PendingMove) -> aio.AIOError | None:
        """Clear a finished move from its copies and return its error, if any. A failed move
        leaves its destination invalid; the source keeps the bytes, so nothing is lost."""
        if move.settled:
            return None
        move.settled = True
        self._moving.discard(move)
        error = None
        try:
            move.wait(0)
        except aio.AIOError as exc:
            error = exc
            exc.add_note(f"store: moving {move.entry.key!r} {move.src_tier.label} -> {move.dst.tier.label}")
        if error is None and move.src is not None and move.src.crc is not None:
            error = self._verify(move)  # a mismatch is a failed read: the copy is not valid
        if move.dst.filling is move:
            move.dst.filling = None
            move.dst.valid = move.dst.valid and error is None
        if move.src is not None and move.src.draining is move:
            move.src.draining = None
        if error is None:
            move.finish(self.moves)
        self._refresh(move.entry)
        return error

    def _verify(self, move: PendingMove) -> aio.AIOError | None:
        """Compare the bytes read from NVMe with the crc32c recorded when they were written."""
        found = aio.crc32c(move.dst.block.tensor)
        if found == move.src.crc:
            return None
        error = aio.AIOError(errno.EIO, f"checksum mismatch reading {move.entry.key!r}: crc32c {found:#010x}, "
                             f"written {move.src.crc:#010x} (the swap file was changed behind the store)",
                             self._swap.name, op="verify", offset=move.src.extent.offset, nbytes=move.entry.nbytes)
        error.add_note(f"store: moving {move.entry.key!r} nvme -> {move.dst.tier.label}")
        return error

    # -- entries -------------------------------------------------------------------------------

    def _entry(self, key: str) -> Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"no tensor {key!r} in the store") from None

    def _register(self, entry: Entry) -> None:
        self._entries[entry.key] = entry
        self._refresh(entry)

    def _refresh(self, entry: Entry) -> None:
        """Bring the eviction queues up to date with the entry's copies."""
        if self._entries.get(entry.key) is not entry:
            return  # being put, or dropped
        for tier, copy in entry.copies.items():
            queue = self._victims.get(tier)
            if queue is not None:
                queue.update(entry, copy)

    def _touch(self, copy: Copy) -> None:
        self._touches += 1
        copy.last_use = self._touches

    # -- moves ---------------------------------------------------------------------------------

    def _start_fetch(self, entry: Entry, tier: Tier) -> Copy:
        """Make sure a copy on `tier` exists and is (or is being) filled; idempotent."""
        copy = entry.copies.get(tier)
        if copy is not None and copy.valid:
            return copy
        source = entry.valid_source(tier)
        if source is None:
            raise RuntimeError(f"{entry.key!r} has no valid copy (a write-back failed earlier?)")
        if tier == Tier.DEVICE and source.tier == Tier.NVME and Tier.HOST in self._arenas:
            self._start_fetch(entry, Tier.HOST)  # staged through host; the device copy is made at result()
            return copy or self._allocate(entry, tier)
        copy = copy or self._allocate(entry, tier)
        self._fill(entry, copy, entry.valid_source(tier))  # making room may have evicted `source`
        return copy

    def _fill(self, entry: Entry, dst: Copy, src: Copy) -> None:
        """Start copying src's bytes into dst: both must be idle (src's bytes landed, earlier
        writes into dst done, so writes to one place stay ordered)."""
        if not src.valid or src.tier not in entry.copies or entry.copies[src.tier] is not src:
            raise RuntimeError(f"{entry.key!r}: a move from a copy that is gone or stale ({src.tier.label})")
        self._need_idle(src)
        self._need_idle(dst)
        start = self.moves.now()
        if src.tier == Tier.NVME:
            move = PendingMove(entry, src, dst, start, request=self._swap.read(self._handle, src.extent, dst.block.tensor))
        elif dst.tier == Tier.NVME:
            dst.crc = aio.crc32c(src.block.tensor) if self.checksum else None
            move = PendingMove(entry, src, dst, start, request=self._swap.write(self._handle, dst.extent, src.block.tensor))
        else:
            move = PendingMove(entry, src, dst, start, event=self._device_copy(dst.block.tensor, src.block.tensor))
        dst.valid = True
        if move.event is None and move.request is None:
            move.finish(self.moves)  # a synchronous copy: already done
        else:  # the source must not be freed or changed until the bytes are out of it
            dst.filling = src.draining = move
            self._moving.add(move)
        self._refresh(entry)

    def _device_copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Copy between host and device tiers; on CUDA on the side stream, returning its event."""
        if self._copy_stream is None:
            dst.copy_(src)
            return None
        # The side stream must see what the caller's stream did to src (e.g. the update before a
        # dirty release) before it reads it.
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._copy_stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        return event

    def _fetched_tensor(self, entry: Entry, tier: Tier) -> torch.Tensor:
        """The fetched copy's tensor once its bytes have landed (a failed read is retried, a
        device copy staged through host is made once the host copy has landed)."""
        if entry.copies.get(tier) is None:
            raise RuntimeError(f"{entry.key!r} left {tier.label} before its fetch completed")
        copy = self._start_fetch(entry, tier)
        if not copy.valid:  # staged: the host copy (started again if it was evicted) lands first
            self._fill(entry, copy, self._start_fetch(entry, Tier.HOST))
        self._need_idle(copy)
        return copy.block.tensor

    def _write_down(self, entry: Entry) -> None:
        """Refresh every stale slower copy from the fastest valid one; idempotent."""
        if self._entries.get(entry.key) is not entry:
            return
        src = next((c for _, c in sorted(entry.copies.items()) if c.valid), None)
        if src is None:
            return
        if src.tier == Tier.DEVICE and self._copy_stream is not None and Tier.NVME in entry.copies \
                and Tier.HOST not in entry.copies:
            self._allocate(entry, Tier.HOST)  # accelerator memory reaches NVMe through the host
        for tier in sorted(t for t in entry.copies if t > src.tier):
            dst = entry.copies[tier]
            if not dst.valid:
                self._fill(entry, dst, src)
            src = dst

    # -- space ---------------------------------------------------------------------------------

    def _tier_below(self, tier: Tier) -> Tier | None:
        for t in (Tier.HOST, Tier.NVME):
            if t > tier and self.budgets.get(t):
                return t
        return None

    def _allocate(self, entry: Entry, tier: Tier) -> Copy:
        """Reserve room for `entry` on `tier`, evicting others as needed."""
        if not self.budgets.get(tier):
            raise ValueError(f"the store has no {tier.label} budget")
        if tier == Tier.NVME:
            copy = Copy(tier, extent=self._swap_alloc(entry))
        else:
            copy = Copy(tier, block=self._arena_alloc(entry, tier))
        entry.copies[tier] = copy
        self._refresh(entry)  # evictable at once: a step that fails before filling it leaks nothing
        return copy

    def _swap_alloc(self, entry: Entry) -> aio.Extent:
        try:
            return self._swap.allocate(entry.nbytes)
        except aio.AIOError:
            raise BudgetError(
                f"nvme tier cannot hold {entry.key!r} ({entry.nbytes} bytes): {self._swap.free_nbytes()} "
                f"of the {self.budgets[Tier.NVME]}-byte nvme budget free (largest hole "
                f"{self._swap.largest_hole_nbytes()}). Drop tensors, or raise the nvme budget."
            ) from None

    def _arena_alloc(self, entry: Entry, tier: Tier) -> Block:
        """A block on `tier`: a hole, else a compaction around copies that must stay put, else
        evictions; see [Note: room on a fragmented tier]."""
        arena = self._arenas[tier]
        span = _span(arena, entry.nbytes)
        compacted_at = None  # free bytes at this call's last compaction
        while True:
            st = arena.stats()
            if st.largest_hole_nbytes >= span:
                return arena.alloc(entry.shape, entry.dtype)
            if span > st.capacity_nbytes:
                raise BudgetError(f"{entry.key!r} ({entry.nbytes} bytes) is larger than the whole "
                                  f"{tier.label} budget ({st.capacity_nbytes} bytes)")
            queue = self._victims.get(tier)
            if queue is not None:
                self._settle_finished()  # a copy whose move has finished is idle: rule 3 of the order
            victim = queue.pick() if queue is not None else None
            if victim is not None and self._prefetching and victim.copies[tier].prefetched:
                victim = None  # only prefetched copies are left: a read ahead never undoes another
            # Moving bytes is cheaper than reading an evicted copy again: compact first, and
            # again once evictions have freed another request's worth; unless the victim would
            # be gone before its next use anyway (see [Note: room on a fragmented tier]).
            if st.free_nbytes >= span and (compacted_at is None or victim is None
                                           or st.free_nbytes >= compacted_at + span) \
                    and not (victim is not None and self._gone_before_use(victim, queue)):
                arena.compact(keep=self._staying(tier))
                compacted_at = st.free_nbytes
                if arena.stats().largest_hole_nbytes >= span:
                    continue
            if victim is None:
                self._no_room(entry, tier, span)
            self._evict(victim, tier)

    def _gone_before_use(self, victim: Entry, queue: VictimQueue) -> bool:
        """Whether the victim's next use is more fetches away than the tier has evictable
        copies: the tier turns over before then, so keeping it would not save its read."""
        return victim.next_use - self._clock > len(queue)

    def _staying(self, tier: Tier) -> list[Block]:
        """Blocks a compaction must not move: copies in use, and those with a move running."""
        return [c.block for e in self._entries.values() if (c := e.copies.get(tier)) is not None
                and c.block is not None and (c.uses or not c.moves_done())]

    def _no_room(self, entry: Entry, tier: Tier, span: int) -> None:
        """Nothing left to evict or compact: wait for I/O on the tier or for a release by another
        thread where that may help, else BudgetError; see [Note: room on a fragmented tier]."""
        for move in self._moving:
            touches = move.dst.tier == tier or (move.src is not None and move.src.tier == tier)
            if touches and not move.done():
                raise _MustWait(move)  # its copy can move or go once it is done
        arena = self._arenas[tier]
        me = threading.get_ident()
        stuck = self._waiting_for_room | {me}
        copies = [c for e in self._entries.values() if (c := e.copies.get(tier)) is not None and c.block is not None]
        in_use = [c for c in copies if c.uses]
        held_by_stuck = [c for c in in_use if any(h in stuck for h in c.holders)]
        releasable = len(held_by_stuck) < len(in_use)
        staying = sum(_span(arena, c.block.nbytes) for c in copies  # pinned, or at home on the tier
                      if not c.uses and (c.pins or tier not in self._victims))
        call, now = self._call, time.monotonic()
        if call.room_deadline is None:
            call.room_waited_from = now
        frees_bytes = tier in self._victims or arena.stats().free_nbytes >= span  # released copies stay
        if releasable and frees_bytes and not self._prefetching \
                and (call.room_deadline is None or now < call.room_deadline) \
                and _gap_for(arena, held_by_stuck, span, staying):
            if call.room_deadline is None:
                call.room_deadline = now + self.room_wait_s
            self._waiting_for_room.add(me)
            self._room_changed()  # threads waiting on what this one holds see it waits too
            raise _MustWaitForRoom(self._room_changes, call.room_deadline)
        st = arena.stats()
        nbytes = {who: sum(_span(arena, c.block.nbytes) for c in in_use if pick(c)) for who, pick in (
            ("all", lambda c: True), ("mine", lambda c: me in c.holders),
            ("waiting", lambda c: any(h in self._waiting_for_room for h in c.holders)))}
        waited = f"; waited {now - call.room_waited_from:.1f} s for releases" if call.room_deadline else ""
        raise BudgetError(
            f"{tier.label} tier cannot hold {entry.key!r}: needs {entry.nbytes} bytes ({span} aligned), "
            f"{st.free_nbytes} of {st.capacity_nbytes} bytes free, largest hole {st.largest_hole_nbytes} "
            f"after compaction; {nbytes['all']} bytes in use ({nbytes['mine']} by this thread, "
            f"{nbytes['waiting']} by threads waiting for room), {staying} pinned or at home on the "
            f"tier{waited}. Release or unpin tensors, or raise the {tier.label} budget."
        )

    def _settle_finished(self) -> None:
        """Settle every move that has finished (the moves in flight, not the whole store)."""
        for move in [m for m in self._moving if m.done()]:
            self._settle(move)

    def _evict(self, entry: Entry, tier: Tier) -> None:
        """Drop entry's copy on `tier`; the last valid copy is first written down a tier."""
        copy = entry.copies[tier]
        self._need_idle(copy)
        if copy.valid and entry.valid_below(tier) is None:
            below = self._tier_below(tier)
            if below is None:
                raise BudgetError(f"cannot evict {entry.key!r} from {tier.label}: no slower tier to move it to")
            try:
                dst = entry.copies.get(below) or self._allocate(entry, below)
            except BudgetError as exc:
                raise BudgetError(f"cannot evict {entry.key!r} from {tier.label}: {exc}") from None
            self._fill(entry, dst, copy)
            if dst.filling is not None:
                raise _MustWait(dst.filling)  # freed at the rerun, once the bytes are down
        self._free_copy(entry, tier)

    def _free_copy(self, entry: Entry, tier: Tier) -> None:
        """Give a copy's space back; it must be idle (no I/O targets it)."""
        copy = entry.copies.pop(tier)
        queue = self._victims.get(tier)
        if queue is not None:
            queue.discard(copy)
        if copy.block is not None:
            self._arenas[tier].free(copy.block)
            self._room_changed()
        if copy.extent is not None:
            self._swap.free(copy.extent)

    # -- lifetime ------------------------------------------------------------------------------

    def _close(self) -> None:
        """Wait for every move, free every tier, then raise the first failed move (the others
        are logged). Threads calling in meanwhile get ValueError (closed)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            moves = [*self._moving, *self._putting.values()]
        self._room_changed()  # threads waiting for room find the store closed, not their deadline
        errors = []
        try:
            for move in moves:
                move.wait_quietly()
            with self._lock:
                errors = [e for e in map(self._settle_move, moves) if e is not None]
                self._entries.clear()
                for queue in self._victims.values():
                    queue.clear()
        finally:
            if self._own_handle and self._handle is not None:
                self._handle.close()
            if self._swap is not None:
                self._swap.close()
            for arena in self._arenas.values():
                arena.close()
        for error in errors[1:]:
            logger.error("at close: %s (%s)", error, "; ".join(getattr(error, "__notes__", [])))
        if errors:
            raise errors[0]



def _span(arena: Arena, nbytes: int) -> int:
    """Bytes a tensor of `nbytes` takes in `arena`."""
    return -(-nbytes // arena.alignment) * arena.alignment


def _gap_for(arena: Arena, fixed: list[Copy], span: int, staying: int) -> bool:
    """Whether `span` bytes could fit once every copy but `fixed` (which stay where they are)
    and `staying` bytes elsewhere had moved or gone: a gap between fixed blocks, and the bytes."""
    spans = sorted((c.block.offset, c.block.offset + _span(arena, c.block.nbytes)) for c in fixed)
    if arena.capacity_nbytes - sum(e - b for b, e in spans) - staying < span:
        return False
    edges = [0, *(x for b, e in spans for x in (b, e)), arena.capacity_nbytes]
    return any(edges[i + 1] - edges[i] >= span for i in range(0, len(edges), 2))
