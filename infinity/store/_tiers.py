"""The store's tiers: each one's budget and memory, the copies placed on it, and making room.

Each tier's memory is reserved once: an Arena for the device and host tiers, one preallocated
aio.SwapFile (and the aio.Handle that moves its bytes) for NVMe. Every method runs under the
store's lock (see [Note: the store's lock] in `_runner`) except where it says otherwise.

[Note: room on a fragmented tier] A copy in use stays put (see [Note: fetched tensors stay put]
in `_copies`), but nothing else does: when a tier's free bytes would hold a request but no hole
does, the arena slides the cheapest stretch of copies that opens the hole, around the copies in
use and those with I/O in flight (`Arena.compact(keep=..., need=...)`, [Note: compacting just
enough] in infinity/memory/arena.py), before evicting anything, unless the copy next in line to
go is needed further away (in fetches) than the tier has evictable copies: the tier turns over
before that use, so evicting it now costs no read that keeping it would save (measured on the
294M GPT with everything on NVMe: a 566 MB host tier compacted ~200 times a step, moving ~8.7
GB, over 1 s of CPU per step). Where the copies in use split the free bytes so that no stretch
holds the request, it evicts, looking for a stretch again after each eviction, and slides every
copy past them (a full compaction) only with nothing left to evict: full compactions forced so
cost a tier 400 MB larger than the plan's 0.5-0.6 s a step on that GPT (int8 state), 0.035 s
this way.
When even evicting every candidate leaves no hole, the step waits without the lock (`Runner.run`),
first for I/O in flight on the tier, then, bounded by `room_wait_s` per call, for a use that
another thread may end (`MustWaitForRoom`), and runs again. It waits only while a release could
help: some copy in use is held only by threads that are not themselves waiting for room, and the
copies held by this thread and by the waiting threads leave a gap large enough. Else (every
holder waits, so waiting would deadlock; the copies this thread holds are in the way; the tier
is too small) it raises BudgetError at once, naming the bytes needed, free, the largest hole,
and those in use. A waiting thread has no place in line: a thread that keeps taking the room
freed (four threads fetching and writing back 16 keys through a host tier of 12) can leave
another waiting until its `room_wait_s` runs out, then BudgetError, never a hang.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

import aio
from aio.buffers import PAGE_NBYTES
from infinity.errors import BudgetError, WouldWait
from infinity.memory import Arena, Block
from infinity.store._common import Tier
from infinity.store._entry import Copy, Entry, Kept, PendingMove
from infinity.store._hints import UseClock
from infinity.store._room import RoomWaits
from infinity.store._runner import MustWait
from infinity.store._victims import VictimQueue


@dataclass(slots=True)
class TierStats:
    """Occupancy of one tier, in bytes."""

    budget_nbytes: int
    used_nbytes: int
    copies: int
    largest_free_nbytes: int


class Evictor(Protocol):
    """What making room asks of the copies (`Copies`)."""

    def settle_finished(self) -> None:
        """Settle every move that has finished, so its copies count as idle."""

    def evict(self, entry: Entry, tier: Tier) -> None:
        """Drop `entry`'s copy on `tier`, writing it down first when it is the last one."""

    def evicts_now(self, entry: Entry, tier: Tier) -> bool:
        """Whether `evict` would drop the copy without waiting for any I/O."""

    def moves_in_flight(self) -> Iterable[PendingMove]:
        """The moves started and not yet settled."""


class Tiers:
    """Each tier's budget and memory, the copies placed on it, which of them may be evicted
    (one VictimQueue per tier that has a slower tier below it), and the threads waiting for
    room (`room`). Opens everything at construction (a missing, read-only or too small
    `nvme_path` fails here) and closes it all if that fails part-way.

    `budgets`, `arenas` and the tiers' order are fixed at construction: read without the lock.
    """

    def __init__(self, budgets: dict[Tier, int], device: torch.device, clock: UseClock, *,
                 nvme_path: str | os.PathLike[str] | None, rank: int,
                 aio_handle: aio.Handle | None, aio_options: Mapping[str, Any] | None,
                 room_wait_s: float) -> None:
        self.budgets = budgets
        self.clock = clock
        self.room = RoomWaits(room_wait_s)
        self.arenas: dict[Tier, Arena] = {}
        self.victims: dict[Tier, VictimQueue] = {}
        self.placed: dict[Tier, dict[Copy, Entry]] = {tier: {} for tier in Tier}
        self.kept_nbytes = {tier: 0 for tier in Tier}  # arena bytes of kept versions' blocks
        self.swap: aio.SwapFile | None = None
        self.handle = aio_handle
        self._own_handle = False
        self.prefetching = False  # a prefetch may not evict copies prefetched before it
        self.waits_for_room = True  # False: WouldWait where making room would wait
        try:
            # Host blocks start on pages so aio moves them with O_DIRECT, never through the cache.
            if budgets.get(Tier.DEVICE):
                self.arenas[Tier.DEVICE] = Arena(
                    budgets[Tier.DEVICE], device,
                    alignment=PAGE_NBYTES if device.type == "cpu" else 256)
            if budgets.get(Tier.HOST):
                self.arenas[Tier.HOST] = Arena(budgets[Tier.HOST], "cpu",
                                               pinned=torch.cuda.is_available(),
                                               alignment=PAGE_NBYTES)
            for tier in self.arenas:
                if self.below(tier) is not None:  # the bottom tier never evicts
                    self.victims[tier] = VictimQueue()
            if budgets.get(Tier.NVME):
                self.swap = _open_swap(nvme_path, budgets[Tier.NVME], rank)
                if self.handle is None:
                    self.handle = aio.Handle(**dict(aio_options or {}))
                    self._own_handle = True
        except BaseException:
            self.close()
            raise

    # -- tiers (no lock needed: fixed at construction) ------------------------------------------

    def fast(self, tier: Tier | str) -> Tier:
        """A tier a fetch, release or pin may name: device or host, with a budget."""
        tier = Tier.of(tier)
        if tier == Tier.NVME:
            raise ValueError("fetch/release/pin work on 'device' or 'host'; NVMe is not "
                             "addressable")
        if tier not in self.arenas:
            raise ValueError(f"the store has no {tier.label} budget")
        return tier

    def below(self, tier: Tier) -> Tier | None:
        """The next slower tier with a budget."""
        for t in (Tier.HOST, Tier.NVME):
            if t > tier and self.budgets.get(t):
                return t
        return None

    # -- the NVMe tier's bytes ------------------------------------------------------------------

    def read(self, extent: aio.Extent, out: torch.Tensor) -> aio.Request:
        return self.swap.read(self.handle, extent, out)

    def write(self, extent: aio.Extent, src: torch.Tensor, *, at: int = 0) -> aio.Request:
        """Start writing `src` at byte `at` of `extent` (thread-safe: no lock needed)."""
        return self.swap.write(self.handle, extent, src, at=at)

    # -- placing copies -------------------------------------------------------------------------

    def allocate(self, entry: Entry, tier: Tier, copies: Evictor) -> Copy:
        """Reserve room for an EMPTY copy of `entry` on `tier`, evicting others as needed."""
        if not self.budgets.get(tier):
            raise ValueError(f"the store has no {tier.label} budget")
        if tier == Tier.NVME:
            copy = Copy(tier, extent=self._extent(entry))
        else:
            copy = Copy(tier, block=self._block(entry, tier, copies))
        entry.copies[tier] = copy
        self.placed[tier][copy] = entry
        return copy

    def free(self, entry: Entry, tier: Tier) -> None:
        """Give a copy's space back; it must be idle (no I/O targets it)."""
        copy = entry.copies.pop(tier)
        del self.placed[tier][copy]
        queue = self.victims.get(tier)
        if queue is not None:
            queue.discard(copy)
        if copy.block is not None:
            self.arenas[tier].free(copy.block)
            self.room.changed()
        if copy.extent is not None:
            self.swap.free(copy.extent)

    def adopt(self, entry: Entry, copy: Copy) -> None:
        """Place a copy whose memory is already reserved (a kept version restored)."""
        entry.copies[copy.tier] = copy
        self.placed[copy.tier][copy] = entry
        if copy.block is not None:
            self.kept_nbytes[copy.tier] -= _span(self.arenas[copy.tier], copy.block.nbytes)

    # -- kept versions; see [Note: kept versions] in `_kept` ------------------------------------

    def shadow_extent(self, entry: Entry) -> aio.Extent:
        """An extent for the next write of `entry`'s NVMe copy (BudgetError: none free)."""
        return self._extent(entry)

    def kept_block(self, entry: Entry, tier: Tier, copies: Evictor) -> Block:
        """A block on `tier` for a kept copy of `entry`'s bytes, made room for as a copy's is;
        it is nobody's copy: never evicted, but moved by compactions like any idle block."""
        block = self._block(entry, tier, copies)
        self.kept_nbytes[tier] += _span(self.arenas[tier], block.nbytes)
        return block

    def free_kept(self, kept: Kept) -> None:
        """Give back what a kept version holds beyond the entry's copies: its block, or its
        extent (or the unused shadow, while the home copy's extent is still the kept one)."""
        if kept.block is not None:
            self.kept_nbytes[kept.tier] -= _span(self.arenas[kept.tier], kept.block.nbytes)
            self.arenas[kept.tier].free(kept.block)
            self.room.changed()
        else:
            self.swap.free(kept.extent if kept.shadow is None else kept.shadow)

    def refresh(self, entry: Entry) -> None:
        """Bring the eviction queues up to date with the entry's copies."""
        for tier, copy in entry.copies.items():
            queue = self.victims.get(tier)
            if queue is not None:
                queue.update(entry, copy)

    @contextlib.contextmanager
    def prefetch(self) -> Iterator[None]:
        """Within: no copy prefetched and not yet fetched is evicted, and nothing waits for room."""
        self.prefetching = True
        try:
            yield
        finally:
            self.prefetching = False

    @contextlib.contextmanager
    def room_now_only(self) -> Iterator[None]:
        """Within: making room never waits (for a copy's I/O, or another thread's release):
        WouldWait instead, before anything is evicted for it."""
        self.waits_for_room = False
        try:
            yield
        finally:
            self.waits_for_room = True

    def _extent(self, entry: Entry) -> aio.Extent:
        try:
            return self.swap.allocate(entry.nbytes)
        except aio.AIOError:
            raise BudgetError(
                f"nvme tier cannot hold {entry.key!r} ({entry.nbytes} bytes): "
                f"{self.swap.free_nbytes()} of the {self.budgets[Tier.NVME]}-byte nvme budget "
                f"free (largest hole {self.swap.largest_hole_nbytes()}). Drop tensors, or raise "
                f"the nvme budget."
            ) from None

    def _block(self, entry: Entry, tier: Tier, copies: Evictor) -> Block:
        """A block on `tier`: a hole, else a compaction around copies that must stay put, else
        evictions; see [Note: room on a fragmented tier]."""
        arena = self.arenas[tier]
        span = _span(arena, entry.nbytes)
        while True:
            st = arena.stats()
            if st.largest_hole_nbytes >= span:
                return arena.alloc(entry.shape, entry.dtype)
            if span > st.capacity_nbytes:
                raise BudgetError(f"{entry.key!r} ({entry.nbytes} bytes) is larger than the whole "
                                  f"{tier.label} budget ({st.capacity_nbytes} bytes)")
            queue = self.victims.get(tier)
            if queue is not None:
                copies.settle_finished()  # a copy whose move has finished is idle: rule 3
            victim = queue.pick() if queue is not None else None
            if victim is not None and self.prefetching and victim.copies[tier].prefetched:
                victim = None  # only prefetched copies are left: a read ahead never undoes another
            # Moving a few copies is cheaper than reading an evicted one again: slide the
            # cheapest stretch that opens the hole (a scan; nothing moves where none does, and
            # each eviction may make one), unless the victim would be gone before its next use
            # anyway. Only with nothing left to evict, slide everything (see [Note: room on a
            # fragmented tier]).
            if st.free_nbytes >= span and not (victim is not None
                                               and self.clock.fetches_until(victim) > len(queue)):
                staying = self._staying(tier)
                arena.compact(keep=staying, need=span)
                if victim is None and arena.stats().largest_hole_nbytes < span:
                    arena.compact(keep=staying)
                if arena.stats().largest_hole_nbytes >= span:
                    continue
            if victim is None:
                self._no_room(entry, tier, span, copies)
            if not self.waits_for_room and not copies.evicts_now(victim, tier):
                raise WouldWait(f"{entry.key!r}: room on {tier.label} waits for {victim.key!r}'s "
                                f"I/O")
            copies.evict(victim, tier)

    def _staying(self, tier: Tier) -> list[Block]:
        """Blocks a compaction must not move: copies in use, and those with a move running."""
        return [c.block for c in self.placed[tier] if c.uses or not c.moves_done()]

    def _no_room(self, entry: Entry, tier: Tier, span: int, copies: Evictor) -> None:
        """Nothing left to evict or compact: wait for I/O on the tier or for a release by another
        thread where that may help, else BudgetError; see [Note: room on a fragmented tier].
        WouldWait instead of either wait within room_now_only()."""
        for move in copies.moves_in_flight():
            touches = move.dst.tier == tier or (move.src is not None and move.src.tier == tier)
            if touches and not move.done():
                if not self.waits_for_room:
                    raise WouldWait(f"{entry.key!r}: room on {tier.label} waits for I/O")
                raise MustWait(move)  # its copy can move or go once it is done
        arena = self.arenas[tier]
        me = threading.get_ident()
        waiting = self.room.waiting()
        stuck = waiting | {me}
        placed = list(self.placed[tier])
        in_use = [c for c in placed if c.uses]
        held_by_stuck = [c for c in in_use if any(h in stuck for h in c.holders)]
        releasable = len(held_by_stuck) < len(in_use)
        staying = self.kept_nbytes[tier] + sum(  # kept versions, pinned, or at home on the tier
            _span(arena, c.block.nbytes) for c in placed
            if not c.uses and (c.pins or tier not in self.victims))
        now = time.monotonic()
        may_wait = self.room.may_wait(now)
        # On a tier that never evicts, a released copy stays: only free bytes can make room.
        frees_bytes = tier in self.victims or arena.stats().free_nbytes >= span
        if releasable and frees_bytes and not self.prefetching and may_wait \
                and _gap_for(arena, held_by_stuck, span, staying):
            if not self.waits_for_room:
                raise WouldWait(f"{entry.key!r}: room on {tier.label} waits for another "
                                f"thread's release")
            raise self.room.must_wait(now)
        st = arena.stats()
        nbytes = {who: sum(_span(arena, c.block.nbytes) for c in in_use if pick(c))
                  for who, pick in (("all", lambda c: True), ("mine", lambda c: me in c.holders),
                                    ("waiting", lambda c: any(h in waiting for h in c.holders)))}
        waited_s = self.room.waited_s(now)
        waited = "" if waited_s is None else f"; waited {waited_s:.1f} s for releases"
        raise BudgetError(
            f"{tier.label} tier cannot hold {entry.key!r}: needs {entry.nbytes} bytes ({span} "
            f"aligned), {st.free_nbytes} of {st.capacity_nbytes} bytes free, largest hole "
            f"{st.largest_hole_nbytes} after compaction; {nbytes['all']} bytes in use "
            f"({nbytes['mine']} by this thread, {nbytes['waiting']} by threads waiting for room), "
            f"{staying} pinned or at home on the tier{waited}. Release or unpin tensors, or raise "
            f"the {tier.label} budget."
        )

    # -- lifetime and figures -------------------------------------------------------------------

    def stats(self) -> dict[str, TierStats]:
        tiers = {}
        for tier, budget in self.budgets.items():
            if tier == Tier.NVME and self.swap is not None:
                used = self.swap.nbytes - self.swap.free_nbytes()
                largest = self.swap.largest_hole_nbytes()
            elif tier in self.arenas:
                st = self.arenas[tier].stats()
                used, largest = st.live_nbytes, st.largest_hole_nbytes
            else:
                used = largest = 0
            tiers[tier.label] = TierStats(budget, used, len(self.placed[tier]), largest)
        return tiers

    def room_stats(self) -> dict[str, Any]:
        """Waits for another thread's release (count, seconds) and compactions per tier."""
        waits, wait_s = self.room.stats()
        return {"waits": waits, "wait_s": wait_s,
                "compactions": {t.label: a.stats().compactions for t, a in self.arenas.items()},
                "compaction_s": {t.label: a.stats().compaction_s for t, a in self.arenas.items()}}

    def forget_all(self) -> None:
        """Drop every record of placed copies (the store is closing; memory is freed by close)."""
        for queue in self.victims.values():
            queue.clear()
        for placed in self.placed.values():
            placed.clear()

    def close(self) -> None:
        """Close the I/O engine (if the store made it), the swap file and the arenas. No lock:
        the store is closed and every move has been waited for."""
        try:
            if self._own_handle and self.handle is not None:
                self.handle.close()
        finally:
            try:
                if self.swap is not None:
                    self.swap.close()
            finally:
                for arena in self.arenas.values():
                    arena.close()


def _open_swap(nvme_path: str | os.PathLike[str] | None, nbytes: int, rank: int) -> aio.SwapFile:
    if nvme_path is None:
        raise ValueError("an NVMe budget needs nvme_path, the directory for the swap file")
    directory = os.fspath(nvme_path)
    try:
        is_dir = os.path.stat.S_ISDIR(os.stat(directory).st_mode)
    except OSError as exc:
        raise aio.AIOError(exc.errno or errno.EIO, f"nvme_path cannot be used: {exc.strerror}",
                           directory, op="open NVMe tier") from None
    if not is_dir:
        raise aio.AIOError(errno.ENOTDIR, "nvme_path is not a directory", directory,
                           op="open NVMe tier")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise aio.AIOError(errno.EACCES, "nvme_path is not writable", directory,
                           op="open NVMe tier")
    name = f"infinity-rank{rank}-pid{os.getpid()}-{uuid.uuid4().hex[:12]}.swap"  # one per store
    return aio.SwapFile(os.path.join(directory, name), nbytes)


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
