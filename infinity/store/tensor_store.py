"""TensorStore: tensors by key across device / host / NVMe, under hard byte budgets.

Each tier's memory is reserved once: an Arena for the device and host tiers, one preallocated
aio.SwapFile for NVMe. An entry has a home (the slowest tier holding it) and may have faster
copies that act as caches. When a tier is full the store evicts the unpinned, unused copy
whose next use is farthest away (hints from the caller), else the least recently used; a home
copy that is evicted moves down a tier.

[Note: fetched tensors stay put] A tensor returned by a fetch is a view of an arena block. The
store never moves or evicts a copy that is in use (fetched, not yet released) and never
compacts an arena while any of its copies is in use or has I/O in flight, so the view stays
valid until `release`. After release it must not be used again.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

import aio
from aio.buffers import PAGE_NBYTES
from infinity.errors import BudgetError
from infinity.memory import Arena
from infinity.store._common import Tier
from infinity.store._entry import Copy, Entry, PendingMove
from infinity.store.moves import MoveLog

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class TierStats:
    """Occupancy of one tier, in bytes."""

    budget_nbytes: int
    used_nbytes: int
    copies: int
    largest_free_nbytes: int


class TensorFuture:
    """The result of a fetch: `result()` waits for the bytes and returns the tensor.

    Duck-compatible with concurrent.futures.Future for `result(timeout)` and `done()`.
    """

    __slots__ = ("_store", "_entry", "_tier", "_tensor")

    def __init__(self, store: TensorStore, entry: Entry, tier: Tier) -> None:
        self._store = store
        self._entry = entry
        self._tier = tier
        self._tensor: torch.Tensor | None = None

    def done(self) -> bool:
        return self._tensor is not None or self._store._ready(self._entry, self._tier)

    def result(self, timeout: float | None = None) -> torch.Tensor:
        """The tensor on the fetched tier, valid until release(); see [Note: fetched tensors stay put].

        Raises AIOTimeoutError after `timeout` seconds, or the AIOError of a failed read; the
        fetch still counts as a use either way, so release() it.
        """
        if self._tensor is None:
            self._tensor = self._store._complete(self._entry, self._tier, timeout)
        return self._tensor


class TensorStore:
    """Tensors by key on device, host and NVMe tiers with hard byte budgets.

    Args:
        budgets: bytes per tier, e.g. {"device": 2 << 30, "host": 8 << 30, "nvme": 200 << 30};
            a missing tier has no budget (and cannot be used).
        nvme_path: directory for the swap file (required with an NVMe budget).
        aio_handle: the I/O engine to use; by default one is made from `aio_options`.
        aio_options: keyword arguments for aio.Handle (block_size, queue_depth, threads, backend).
        device: the device tier's device; default CUDA when present, else host memory.
        rank: data-parallel rank, part of the swap file's name.

    Thread-safe: every method takes the store's lock; I/O is waited for outside it where the
    caller waits (TensorFuture.result).
    """

    def __init__(self, budgets: Mapping[Tier | str, int], *, nvme_path: str | os.PathLike[str] | None = None,
                 aio_handle: aio.Handle | None = None, aio_options: Mapping[str, Any] | None = None,
                 device: str | torch.device | None = None, rank: int = 0,
                 keep_timeline: bool = True) -> None:
        self.budgets = {Tier.of(t): int(n) for t, n in budgets.items()}
        for tier, nbytes in self.budgets.items():
            if nbytes < 0:
                raise ValueError(f"budget for {tier.label} must be >= 0 bytes, got {nbytes}")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type != "cpu" and self.budgets.get(Tier.NVME) and not self.budgets.get(Tier.HOST):
            raise ValueError("NVMe <-> accelerator moves are staged in host memory: give the host tier a budget")
        self._lock = threading.RLock()
        self._entries: dict[str, Entry] = {}
        self._clock = 0
        self.moves = MoveLog(keep_timeline=keep_timeline)
        self._arenas: dict[Tier, Arena] = {}
        self._swap: aio.SwapFile | None = None
        self._own_handle = aio_handle is None
        self._handle: aio.Handle | None = aio_handle
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        try:
            # Host blocks start on pages so aio moves them with O_DIRECT, never through the cache.
            if self.budgets.get(Tier.DEVICE):
                self._arenas[Tier.DEVICE] = Arena(self.budgets[Tier.DEVICE], self.device,
                                                  alignment=PAGE_NBYTES if self.device.type == "cpu" else 256)
            if self.budgets.get(Tier.HOST):
                self._arenas[Tier.HOST] = Arena(self.budgets[Tier.HOST], "cpu", pinned=torch.cuda.is_available(),
                                                alignment=PAGE_NBYTES)
            if self.budgets.get(Tier.NVME):
                self._swap = self._open_swap(nvme_path, self.budgets[Tier.NVME], rank)
                if self._handle is None:
                    self._handle = aio.Handle(**dict(aio_options or {}))
        except BaseException:
            self.close()
            raise

    @staticmethod
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
            raise aio.AIOError(errno.ENOTDIR, "nvme_path is not a directory", directory, op="open NVMe tier")
        if not os.access(directory, os.W_OK | os.X_OK):
            raise aio.AIOError(errno.EACCES, "nvme_path is not writable", directory, op="open NVMe tier")
        name = f"infinity-rank{rank}-pid{os.getpid()}-{uuid.uuid4().hex[:12]}.swap"  # one per store
        return aio.SwapFile(os.path.join(directory, name), nbytes)

    # -- public verbs --------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor, tier: Tier | str = Tier.NVME) -> None:
        """Store a copy of `tensor` under a new `key`, at home on `tier` (returns once stored)."""
        tier = Tier.of(tier)
        with self._lock:
            if key in self._entries:
                raise ValueError(f"key {key!r} is already in the store; drop() it first")
            entry = Entry(key, tensor.shape, tensor.dtype, tensor.numel() * tensor.element_size(), tier)
            copy = self._allocate(entry, tier)
            start = self.moves.now()
            try:
                if tier == Tier.NVME:
                    source = tensor.detach().to("cpu").contiguous()
                    self._swap.write(self._handle, copy.extent, source).wait()
                else:
                    copy.block.tensor.copy_(tensor.detach())
            except BaseException:
                self._free_copy(entry, tier)  # the entry was never registered: give its space back
                raise
            self.moves.record(key, Tier.HOST if tensor.device.type == "cpu" else Tier.DEVICE, tier,
                              entry.nbytes, start, self.moves.now())
            copy.valid = True
            self._entries[key] = entry

    def fetch(self, key: str, tier: Tier | str = Tier.HOST, *, next_use: float | None = None) -> TensorFuture:
        """Start bringing `key` to `tier` ("device" or "host"); the copy is in use until release()."""
        tier = self._fast_tier(tier)
        with self._lock:
            entry = self._entry(key)
            copy = self._start_fetch(entry, tier)
            copy.uses += 1
            copy.prefetched = False
            if next_use is not None:
                entry.next_use = next_use
            return TensorFuture(self, entry, tier)

    def prefetch(self, keys: Iterable[str], tier: Tier | str = Tier.HOST) -> None:
        """Start bringing `keys` to `tier` without taking a use; stops quietly when the tier is full."""
        tier = self._fast_tier(tier)
        with self._lock:
            for key in keys:
                entry = self._entry(key)
                try:
                    copy = self._start_fetch(entry, Tier.HOST if tier == Tier.DEVICE and Tier.HOST in self._arenas else tier)
                except BudgetError:
                    return
                copy.prefetched = copy.uses == 0

    def release(self, key: str, tier: Tier | str = Tier.HOST, *, dirty: bool = False) -> None:
        """End a fetch. With dirty=True the tensor was modified: it is written down to its home
        (asynchronously) and copies on other tiers are dropped."""
        tier = self._fast_tier(tier)
        with self._lock:
            entry = self._entry(key)
            copy = entry.copies.get(tier)
            if copy is None or copy.uses == 0:
                raise ValueError(f"release of {key!r} on {tier.label} without a fetch")
            copy.uses -= 1
            if dirty:
                self._mark_modified(entry, tier)

    def set_next_use(self, hints: Mapping[str, float]) -> None:
        """Tell the store when keys are needed next (any increasing unit, e.g. step index)."""
        with self._lock:
            for key, when in hints.items():
                self._entry(key).next_use = when

    def pin(self, key: str, tier: Tier | str = Tier.HOST) -> None:
        """Keep `key` resident on `tier` (fetching it if needed) until unpin()."""
        tier = self._fast_tier(tier)
        with self._lock:
            entry = self._entry(key)
            self._start_fetch(entry, tier).pins += 1
        self._complete(entry, tier, None)

    def unpin(self, key: str, tier: Tier | str = Tier.HOST) -> None:
        tier = self._fast_tier(tier)
        with self._lock:
            copy = self._entry(key).copies.get(tier)
            if copy is None or copy.pins == 0:
                raise ValueError(f"unpin of {key!r} on {tier.label} that is not pinned")
            copy.pins -= 1

    def evict(self, key: str, tier: Tier | str) -> None:
        """Drop the copy of `key` on `tier` now; a home copy moves down a tier."""
        tier = Tier.of(tier)
        with self._lock:
            entry = self._entry(key)
            copy = entry.copies.get(tier)
            if copy is None:
                return
            if not copy.evictable:
                raise ValueError(f"cannot evict {key!r} from {tier.label}: it is in use or pinned")
            self._evict(entry, tier)

    def drop(self, key: str) -> None:
        """Forget `key` and free its space on every tier."""
        with self._lock:
            entry = self._entry(key)
            if any(c.uses for c in entry.copies.values()):
                raise ValueError(f"cannot drop {key!r}: it is in use (fetched, not released)")
            for tier in list(entry.copies):
                self._free_copy(entry, tier)
            del self._entries[key]

    def flush(self) -> None:
        """Wait for every move in flight; raises the first I/O error."""
        with self._lock:
            for entry in list(self._entries.values()):
                for copy in list(entry.copies.values()):
                    self._settle(copy)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def tiers_of(self, key: str) -> list[str]:
        """Tiers holding a valid copy of `key`, fastest first."""
        with self._lock:
            return [t.label for t, c in sorted(self._entry(key).copies.items()) if c.valid]

    def unsaved(self, key: str) -> bool:
        """Whether a slower copy of `key` lacks changes a faster one holds because their
        write-back failed; the store keeps the faster copy (writing it down again before
        evicting it) and the caller may retry with fetch + release(dirty=True)."""
        with self._lock:
            copies = sorted(self._entry(key).copies.items())
            return any(c.valid and any(not s.valid and s.filling is None for t, s in copies if t > tier)
                       for tier, c in copies)

    def stats(self) -> dict[str, Any]:
        """Per-tier occupancy and per-direction move counters."""
        with self._lock:
            tiers = {}
            for tier, budget in self.budgets.items():
                copies = [e.copies[tier] for e in self._entries.values() if tier in e.copies]
                if tier == Tier.NVME and self._swap is not None:
                    used = self._swap.nbytes - self._swap.free_nbytes()
                    largest = self._swap.largest_hole_nbytes()
                elif tier in self._arenas:
                    st = self._arenas[tier].stats()
                    used, largest = st.live_nbytes, st.largest_hole_nbytes
                else:
                    used = largest = 0
                tiers[tier.label] = TierStats(budget, used, len(copies), largest)
            return {"tiers": tiers, "moves": self.moves.summary()}

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """Save every move as a Chrome / Perfetto trace (JSON)."""
        self.moves.write_trace(path)

    def close(self) -> None:
        """Wait for moves in flight, then free every tier and remove the swap file."""
        try:
            with self._lock:
                for entry in self._entries.values():
                    for copy in entry.copies.values():
                        if copy.busy:
                            self._settle(copy, raise_errors=False)
                self._entries.clear()
        finally:
            if self._own_handle and self._handle is not None:
                self._handle.close()
            if self._swap is not None:
                self._swap.close()
            for arena in self._arenas.values():
                arena.close()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- fetching ------------------------------------------------------------------------------

    def _fast_tier(self, tier: Tier | str) -> Tier:
        tier = Tier.of(tier)
        if tier == Tier.NVME:
            raise ValueError("fetch/release/pin work on 'device' or 'host'; NVMe is not addressable")
        if tier not in self._arenas:
            raise ValueError(f"the store has no {tier.label} budget")
        return tier

    def _entry(self, key: str) -> Entry:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"no tensor {key!r} in the store") from None

    def _start_fetch(self, entry: Entry, tier: Tier) -> Copy:
        """Make sure a copy on `tier` exists and is (or is being) filled. Lock held."""
        self._clock += 1
        copy = entry.copies.get(tier)
        if copy is not None and copy.valid:
            copy.last_use = self._clock
            return copy
        source = entry.valid_below(tier)
        if source is None:
            raise RuntimeError(f"{entry.key!r} has no valid copy (a write-back failed earlier?)")
        if tier == Tier.DEVICE and source.tier == Tier.NVME and Tier.HOST in self._arenas:
            self._start_fetch(entry, Tier.HOST)  # staged through host; the device copy is made at result()
            copy = copy or self._allocate(entry, tier)
        else:
            copy = copy or self._allocate(entry, tier)
            self._fill(entry, copy, source)
        copy.last_use = self._clock
        return copy

    def _fill(self, entry: Entry, dst: Copy, src: Copy) -> None:
        """Start copying src's bytes into dst. Lock held."""
        self._settle(src)  # its own bytes must have landed, and earlier write-backs be ordered
        start = self.moves.now()
        if src.tier == Tier.NVME:
            request = self._swap.read(self._handle, src.extent, dst.block.tensor)
            dst.filling = PendingMove(entry.key, Tier.NVME, dst.tier, entry.nbytes, start, request=request)
        elif dst.tier == Tier.NVME:
            request = self._swap.write(self._handle, dst.extent, src.block.tensor)
            move = PendingMove(entry.key, src.tier, Tier.NVME, entry.nbytes, start, request=request)
            src.draining = dst.filling = move
        else:
            event = self._device_copy(dst.block.tensor, src.block.tensor)
            move = PendingMove(entry.key, src.tier, dst.tier, entry.nbytes, start, event=event)
            if event is None:
                move.finish(self.moves)
            else:  # the source must not be freed or changed until the side stream has read it
                dst.filling = src.draining = move
        dst.valid = True

    def _device_copy(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Copy between host and device tiers; on CUDA on the side stream, returning its event."""
        if self._copy_stream is None:
            dst.copy_(src)
            return None
        with torch.cuda.stream(self._copy_stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        return event

    def _ready(self, entry: Entry, tier: Tier) -> bool:
        with self._lock:
            copy = entry.copies.get(tier)
            if copy is None or not copy.valid:
                return False
            return copy.moves_done()

    def _complete(self, entry: Entry, tier: Tier, timeout: float | None) -> torch.Tensor:
        """Wait for the fetched copy (I/O outside the lock) and return its tensor."""
        while True:
            with self._lock:
                copy = entry.copies.get(tier)
                if copy is None:
                    raise RuntimeError(f"{entry.key!r} left {tier.label} before its fetch completed")
                if copy.valid:
                    pending = copy.filling or copy.draining
                    if pending is None:
                        return copy.block.tensor
                else:  # a device copy waiting for its bytes to be staged on the host
                    host = entry.copies.get(Tier.HOST)
                    if host is None or not host.valid:
                        self._start_fetch(entry, Tier.HOST)  # the stage was evicted meanwhile
                        continue
                    if host.filling is None:
                        self._fill(entry, copy, host)
                        continue
                    pending = host.filling
            try:
                pending.wait(timeout)
            except aio.AIOTimeoutError:
                raise
            except aio.AIOError:
                pass  # settled below, which marks the copy and raises the error
            with self._lock:
                self._settle_move(pending)

    # -- writing back --------------------------------------------------------------------------

    def _mark_modified(self, entry: Entry, tier: Tier) -> None:
        """The copy on `tier` was changed: drop faster copies, refresh slower ones. Lock held."""
        for t, other in entry.copies.items():
            if t != tier and other.uses:
                raise ValueError(f"{entry.key!r} was modified on {tier.label} while in use on {t.label}")
        for t in [t for t in entry.copies if t < tier]:
            self._free_copy(entry, t)
        if tier == Tier.DEVICE and self._copy_stream is not None and Tier.NVME in entry.copies \
                and Tier.HOST not in entry.copies:
            self._allocate(entry, Tier.HOST)  # accelerator memory reaches NVMe through the host
        src = entry.copies[tier]
        for t in sorted(t for t in entry.copies if t > tier):
            dst = entry.copies[t]
            self._settle(dst)
            dst.valid = False
            self._fill(entry, dst, src)
            src = dst

    def _settle(self, copy: Copy, *, raise_errors: bool = True) -> None:
        """Wait for the moves in and out of `copy` and record them. Lock held."""
        for move in (copy.filling, copy.draining):
            if move is not None:
                self._settle_move(move, raise_errors=raise_errors)

    def _settle_move(self, move: PendingMove, *, raise_errors: bool = True) -> None:
        """Wait for one move; on failure the destination is marked invalid (the source keeps
        the bytes, so nothing is lost) and the AIOError is raised. Lock held."""
        error = None
        try:
            move.wait()
        except aio.AIOError as exc:
            error = exc
        entry = self._entries.get(move.key)
        for c in entry.copies.values() if entry is not None else ():
            if c.filling is move:
                c.filling = None
                c.valid = c.valid and error is None
            if c.draining is move:
                c.draining = None
        if error is None:
            move.finish(self.moves)
        elif raise_errors:
            raise error
        else:
            logger.error("%s: move %s -> %s failed: %s", move.key, move.src.label, move.dst.label, error)

    # -- space ---------------------------------------------------------------------------------

    def _allocate(self, entry: Entry, tier: Tier) -> Copy:
        """Reserve room for `entry` on `tier`, evicting others as needed. Lock held."""
        if tier not in self.budgets or not self.budgets[tier]:
            raise ValueError(f"the store has no {tier.label} budget")
        copy = Copy(tier)
        if tier == Tier.NVME:
            try:
                copy.extent = self._swap.allocate(entry.nbytes)
            except aio.AIOError as exc:
                raise BudgetError(f"NVMe tier full: cannot hold {entry.key!r} ({entry.nbytes} bytes): {exc}") from None
        else:
            copy.block = self._arena_alloc(entry, tier)
        entry.copies[tier] = copy
        return copy

    def _arena_alloc(self, entry: Entry, tier: Tier):
        arena = self._arenas[tier]
        span = -(-entry.nbytes // arena.alignment) * arena.alignment
        while True:
            st = arena.stats()
            if st.largest_hole_nbytes >= span:
                return arena.alloc(entry.shape, entry.dtype)
            if st.free_nbytes >= span and self._may_compact(tier):
                self._quiesce(tier)  # compaction moves blocks: no I/O may target them
                return arena.alloc(entry.shape, entry.dtype)
            if span > st.capacity_nbytes:
                raise BudgetError(f"{entry.key!r} ({entry.nbytes} bytes) is larger than the whole "
                                  f"{tier.label} budget ({st.capacity_nbytes} bytes)")
            victim = self._pick_victim(tier, exclude=entry)
            if victim is None:
                raise BudgetError(
                    f"{tier.label} tier cannot hold {entry.key!r} ({entry.nbytes} bytes): "
                    f"{st.free_nbytes} of {st.capacity_nbytes} bytes free (largest hole "
                    f"{st.largest_hole_nbytes}); the rest is in use, pinned, or has nowhere to go. "
                    f"Release or unpin tensors, or raise the {tier.label} budget."
                )
            self._evict(victim, tier)

    def _may_compact(self, tier: Tier) -> bool:
        return not any(e.copies[tier].uses for e in self._entries.values() if tier in e.copies)

    def _quiesce(self, tier: Tier) -> None:
        for entry in list(self._entries.values()):
            copy = entry.copies.get(tier)
            if copy is not None and copy.busy:
                self._settle(copy)

    def _pick_victim(self, tier: Tier, exclude: Entry) -> Entry | None:
        """The evictable entry on `tier` used farthest in the future, else least recently.

        Prefetched copies not yet fetched go last (evicting one wastes its read). Among copies
        needed equally late, idle ones go first: evicting one with a move in flight would wait
        for that I/O (e.g. a write-back just started)."""
        best, best_rank = None, None
        for entry in self._entries.values():
            copy = entry.copies.get(tier)
            if entry is exclude or copy is None or not copy.evictable:
                continue
            if tier == entry.home and self._tier_below(tier) is None:
                continue
            rank = (not copy.prefetched, entry.next_use, copy.moves_done(), -copy.last_use)
            if best_rank is None or rank > best_rank:
                best, best_rank = entry, rank
        return best

    def _tier_below(self, tier: Tier) -> Tier | None:
        for t in (Tier.HOST, Tier.NVME):
            if t > tier and self.budgets.get(t):
                return t
        return None

    def _evict(self, entry: Entry, tier: Tier) -> None:
        """Drop entry's copy on `tier`; a home copy first moves down. Lock held."""
        copy = entry.copies[tier]
        self._settle(copy)
        if tier == entry.home or entry.valid_below(tier) is None:  # also: the only current bytes
            below = self._tier_below(tier)  # after a failed write-back are written down first
            if below is None:
                raise BudgetError(f"cannot evict {entry.key!r} from {tier.label}: no slower tier to move it to")
            dst = entry.copies.get(below) or self._allocate(entry, below)
            self._fill(entry, dst, copy)
            self._settle(dst)
            entry.home = max(entry.home, below)
        self._free_copy(entry, tier)

    def _free_copy(self, entry: Entry, tier: Tier) -> None:
        copy = entry.copies[tier]
        self._settle(copy, raise_errors=False)
        if copy.block is not None:
            self._arenas[tier].free(copy.block)
        if copy.extent is not None:
            self._swap.free(copy.extent)
        del entry.copies[tier]
