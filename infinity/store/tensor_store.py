"""TensorStore: tensors by key across device / host / NVMe, under hard byte budgets.

Each tier's memory is reserved once: an Arena for the device and host tiers, one preallocated
aio.SwapFile for NVMe. An entry has a home (the slowest tier holding it) and may have faster
copies that act as caches. When a tier is full the store evicts a copy that is not in use
nor pinned, in the order of [Note: eviction order] (prefetched-unused last, farthest next use,
idle before busy, least recently used); the last valid copy of a tensor that is evicted is
first written down a tier. See [Note: fetched tensors stay put] and [Note: no waiting under
the lock] in `_core`.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

import aio
from infinity.errors import BudgetError
from infinity.store._common import Tier
from infinity.store._core import StoreCore
from infinity.store._entry import Copy, Entry, PendingMove

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

        Raises AIOTimeoutError after `timeout` seconds, or the AIOError of a failed read (a
        later call reads again); the fetch still counts as a use either way, so release() it.
        """
        if self._tensor is None:
            self._tensor = self._store._run(lambda: self._store._fetched_tensor(self._entry, self._tier), timeout)
        return self._tensor


class TensorStore(StoreCore):
    """Tensors by key on device, host and NVMe tiers with hard byte budgets.

    Args:
        budgets: bytes per tier, e.g. {"device": 2 << 30, "host": 8 << 30, "nvme": 200 << 30};
            a missing tier has no budget (and cannot be used).
        nvme_path: directory for the swap file (required with an NVMe budget).
        aio_handle: the I/O engine to use; by default one is made from `aio_options`.
        aio_options: keyword arguments for aio.Handle (block_size, queue_depth, threads, backend).
        device: the device tier's device; default CUDA when present, else host memory.
        rank: data-parallel rank, part of the swap file's name (used only where the file system
            cannot create it unlinked at once, see aio.SwapFile).
        keep_timeline: record every move for write_trace (counters are kept either way).
        checksum: record a crc32c of every tensor written to NVMe and check it on every read
            back; a mismatch (the swap file changed behind the store) is an AIOError naming
            the key, the file and the offset, and the read copy is not used. Off by default:
            it costs 10-20% of an optimizer step (docs/performance.md).
        room_wait_s: how long one call may wait for another thread to release a copy in use
            when a tier has no room for it otherwise (see [Note: room on a fragmented tier] in
            `_core`); a wait that cannot end (every holder waits too) raises BudgetError at once.

    The store has a clock, `clock`: the number of fetches so far. Next-use hints are distances
    on it: `set_next_use({key: d})` means "needed at the d-th fetch from now".

    Thread-safe. No call waits for I/O while holding the store's lock (see [Note: no waiting
    under the lock]), so a thread blocked on a slow write-back never stalls another's fetch
    of a resident tensor.
    """

    def __init__(self, budgets: Mapping[Tier | str, int], *, nvme_path: str | os.PathLike[str] | None = None,
                 aio_handle: aio.Handle | None = None, aio_options: Mapping[str, Any] | None = None,
                 device: str | torch.device | None = None, rank: int = 0,
                 keep_timeline: bool = True, checksum: bool = False, room_wait_s: float = 30.0) -> None:
        budgets = {Tier.of(t): int(n) for t, n in budgets.items()}
        for tier, nbytes in budgets.items():
            if nbytes < 0:
                raise ValueError(f"budget for {tier.label} must be >= 0 bytes, got {nbytes}")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type != "cpu" and budgets.get(Tier.NVME) and not budgets.get(Tier.HOST):
            raise ValueError("NVMe <-> accelerator moves are staged in host memory: give the host tier a budget")
        if not room_wait_s >= 0:
            raise ValueError(f"room_wait_s must be >= 0 seconds, got {room_wait_s!r}")
        super().__init__(budgets, device, aio_handle, aio_handle is None, keep_timeline, checksum, room_wait_s)
        try:
            self._open_arenas()
            if budgets.get(Tier.NVME):
                self._swap = self._open_swap(nvme_path, budgets[Tier.NVME], rank)
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

    @property
    def clock(self) -> int:
        """Fetches so far: the clock of next-use hints."""
        return self._clock

    # -- public verbs --------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor, tier: Tier | str = Tier.NVME) -> None:
        """Store a copy of `tensor` under a new `key`, at home on `tier` (returns once stored)."""
        tier = Tier.of(tier)
        source = tensor.detach().to("cpu").contiguous() if tier == Tier.NVME else tensor.detach()
        entry = Entry(key, tensor.shape, tensor.dtype, tensor.numel() * tensor.element_size(), next(self._orders))
        source_tier = Tier.HOST if tensor.device.type == "cpu" else Tier.DEVICE
        crc = aio.crc32c(source) if self.checksum and tier == Tier.NVME else None

        def reserve() -> PendingMove | None:
            if key in self._entries or key in self._putting:
                raise ValueError(f"key {key!r} is already in the store; drop() it first")
            copy = self._allocate(entry, tier)
            start = self.moves.now()
            if tier != Tier.NVME:  # a memory copy: done under the lock
                copy.block.tensor.copy_(source)
                copy.valid = True
                self.moves.record(key, source_tier, tier, entry.nbytes, start, self.moves.now())
                self._register(entry)
                return None
            try:
                request = self._swap.write(self._handle, copy.extent, source)
            except BaseException:
                self._free_copy(entry, tier)
                raise
            copy.filling = move = PendingMove(entry, None, copy, start, request=request, src_tier=source_tier)
            copy.valid = True
            copy.crc = crc
            self._putting[key] = move
            return move

        move = self._run(reserve)
        if move is None:
            return
        move.wait_quietly()
        with self._lock:
            self._putting.pop(key, None)
            self._check_open()  # close() has settled the move and freed the tier
            error = self._settle_move(move)
            if error is not None:
                self._free_copy(entry, tier)  # the entry was never registered: give its space back
                raise error
            self._register(entry)

    def put_chunks(self, key: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
                   chunks: Iterable[torch.Tensor], tier: Tier | str = Tier.NVME) -> None:
        """Store a new `key` of `shape` and `dtype` whose values arrive in pieces, in order (each
        a CPU tensor of `dtype`, flattened), so the caller never holds the whole tensor: a
        loader streams a tensor larger than its memory window. Each piece is written (NVMe) or
        copied (host, device) before the next is asked for; pieces whose byte sizes are
        multiples of 4096 keep NVMe writes direct. The key exists once every byte has landed;
        on any error (including too few or too many elements) nothing is left of it.
        """
        tier = Tier.of(tier)
        shape = torch.Size(shape)
        entry = Entry(key, shape, dtype, shape.numel() * dtype.itemsize, next(self._orders))

        def reserve() -> Copy:
            if key in self._entries or key in self._putting:
                raise ValueError(f"key {key!r} is already in the store; drop() it first")
            copy = self._allocate(entry, tier)
            copy.pins += 1  # never a victim while it fills
            return copy

        copy = self._run(reserve)
        start, done, crc = self.moves.now(), 0, 0
        try:
            for chunk in chunks:
                piece = chunk.detach().reshape(-1)
                if piece.dtype != dtype or piece.device.type != "cpu":
                    raise ValueError(f"put_chunks({key!r}): a piece is {piece.dtype} on {piece.device}, "
                                     f"expected {dtype} on cpu")
                nbytes = piece.numel() * dtype.itemsize
                if done + nbytes > entry.nbytes:
                    raise ValueError(f"put_chunks({key!r}): pieces exceed {entry.nbytes} bytes")
                if tier == Tier.NVME:
                    self._swap.write(self._handle, copy.extent, piece, at=done).wait()
                    if self.checksum:
                        crc = aio.crc32c(piece, crc)
                else:
                    with self._lock:  # the arena may have moved the block (compaction)
                        copy.block.tensor.view(-1)[done // dtype.itemsize:][:piece.numel()].copy_(piece)
                done += nbytes
            if done != entry.nbytes:
                raise ValueError(f"put_chunks({key!r}): pieces gave {done} of {entry.nbytes} bytes")
        except BaseException:
            with self._lock:
                copy.pins -= 1
                if not self._closed:
                    self._free_copy(entry, tier)
            raise
        with self._lock:
            self._check_open()
            copy.pins -= 1
            copy.valid = True
            copy.crc = crc if self.checksum and tier == Tier.NVME else None
            self.moves.record(key, Tier.HOST, tier, entry.nbytes, start, self.moves.now())
            self._register(entry)

    def fetch(self, key: str, tier: Tier | str = Tier.HOST, *, next_use: float | None = None) -> TensorFuture:
        """Start bringing `key` to `tier` ("device" or "host"); the copy is in use until release().

        `next_use`: when it is needed again, as a distance on the store's clock from now
        (as in set_next_use)."""
        tier = self._fast_tier(tier)
        if next_use is not None:
            _check_distance(key, next_use)

        def start() -> TensorFuture:
            entry = self._entry(key)
            copy = self._start_fetch(entry, tier)
            self._clock += 1
            self._touch(copy)
            copy.holders.append(threading.get_ident())
            copy.prefetched = False
            if next_use is not None:
                entry.next_use = self._clock + next_use
            self._refresh(entry)
            return TensorFuture(self, entry, tier)

        return self._run(start)

    def prefetch(self, keys: Iterable[str], tier: Tier | str = Tier.HOST) -> list[str]:
        """Start bringing `keys` to `tier` without taking a use (a device prefetch stops on the
        host when there is one). Returns the keys started or found present or in flight; stops
        at the first key that does not fit without evicting a copy in use, pinned, or itself
        prefetched and not yet fetched (logged at debug level)."""
        tier = self._fast_tier(tier)
        target = Tier.HOST if tier == Tier.DEVICE and Tier.HOST in self._arenas else tier

        def start(key: str) -> None:
            entry = self._entry(key)
            self._prefetching = True
            try:
                copy = self._start_fetch(entry, target)
            finally:
                self._prefetching = False
            self._touch(copy)
            copy.prefetched = copy.uses == 0
            self._refresh(entry)

        started = []
        for key in keys:
            try:
                self._run(lambda: start(key))  # noqa: B023 (run at once)
            except BudgetError as exc:
                logger.debug("prefetch to %s stops at %r: %s", target.label, key, exc)
                break
            started.append(key)
        return started

    def release(self, key: str, tier: Tier | str = Tier.HOST, *, dirty: bool = False) -> None:
        """End a fetch. With dirty=True the tensor was modified: it is written down to its home
        (asynchronously) and copies on faster tiers are dropped. Waits (without the lock) for
        an earlier write-back of the same key to finish first, so writes land in order."""
        tier = self._fast_tier(tier)

        def end() -> Entry:
            entry = self._entry(key)
            copy = entry.copies.get(tier)
            if copy is None or copy.uses == 0:
                raise ValueError(f"release of {key!r} on {tier.label} without a fetch")
            if dirty:
                for t, other in entry.copies.items():
                    if t != tier and other.uses:
                        raise ValueError(f"{key!r} was modified on {tier.label} while in use on {t.label}")
                for other in list(entry.copies.values()):
                    self._need_idle(other)
            me = threading.get_ident()
            copy.holders.remove(me if me in copy.holders else copy.holders[0])  # handed to this thread
            if dirty:
                for t in [t for t in entry.copies if t < tier]:
                    self._free_copy(entry, t)
                for t in [t for t in entry.copies if t > tier]:
                    entry.copies[t].valid = False
            self._refresh(entry)
            self._room_changed()
            return entry

        entry = self._run(end)
        if dirty:
            self._run(lambda: self._write_down(entry))

    def set_next_use(self, hints: Mapping[str, float]) -> None:
        """Tell the store when keys are needed next, as distances on its clock from now:
        {key: d} means at the d-th fetch from now. Smaller is sooner; the copy needed farthest
        away is evicted first."""
        for key, distance in hints.items():
            _check_distance(key, distance)
        with self._lock:
            self._check_open()
            for key, distance in hints.items():
                entry = self._entry(key)
                entry.next_use = self._clock + distance
                self._refresh(entry)

    def pin(self, key: str, tier: Tier | str = Tier.HOST) -> None:
        """Keep `key` resident on `tier` (fetching it if needed) until unpin()."""
        tier = self._fast_tier(tier)

        def start() -> Entry:
            entry = self._entry(key)
            copy = self._start_fetch(entry, tier)
            self._touch(copy)
            copy.pins += 1
            self._refresh(entry)
            return entry

        entry = self._run(start)
        self._run(lambda: self._fetched_tensor(entry, tier))

    def unpin(self, key: str, tier: Tier | str = Tier.HOST) -> None:
        tier = self._fast_tier(tier)
        with self._lock:
            self._check_open()
            entry = self._entry(key)
            copy = entry.copies.get(tier)
            if copy is None or copy.pins == 0:
                raise ValueError(f"unpin of {key!r} on {tier.label} that is not pinned")
            copy.pins -= 1
            self._refresh(entry)
            self._room_changed()

    def evict(self, key: str, tier: Tier | str) -> None:
        """Drop the copy of `key` on `tier` now; the last valid copy is first written down a
        tier (waiting for that write, without the lock)."""
        tier = Tier.of(tier)

        def drop_copy() -> None:
            entry = self._entry(key)
            copy = entry.copies.get(tier)
            if copy is None:
                return
            if copy.uses or copy.pins:
                raise ValueError(f"cannot evict {key!r} from {tier.label}: it is in use ({copy.uses} "
                                 f"fetches not released) or pinned ({copy.pins} pins)")
            self._evict(entry, tier)

        self._run(drop_copy)

    def drop(self, key: str) -> None:
        """Forget `key` and free its space on every tier (waiting for its moves, without the lock)."""
        def forget() -> None:
            entry = self._entry(key)
            in_use = [t.label for t, c in entry.copies.items() if c.uses]
            if in_use:
                raise ValueError(f"cannot drop {key!r}: it is in use on {', '.join(in_use)} (fetched, not released)")
            for copy in list(entry.copies.values()):
                self._need_idle(copy, quiet=True)  # its bytes are discarded: a failed move is logged
            for tier in list(entry.copies):
                self._free_copy(entry, tier)
            del self._entries[key]

        self._run(forget)

    def flush(self) -> None:
        """Wait for every move started before the call; raises the first I/O error."""
        with self._lock:
            self._check_open()
            moves = list(self._moving)
        for move in moves:
            move.wait_quietly()
            with self._lock:
                self._settle(move)

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
        """Per-tier occupancy, per-direction move counters, and "room": waits for another
        thread's release (count, seconds) and compactions per tier (count, seconds)."""
        with self._lock:
            tiers = {}
            for tier, budget in self.budgets.items():
                copies = sum(tier in e.copies for e in self._entries.values())
                if tier == Tier.NVME and self._swap is not None:
                    used = self._swap.nbytes - self._swap.free_nbytes()
                    largest = self._swap.largest_hole_nbytes()
                elif tier in self._arenas:
                    st = self._arenas[tier].stats()
                    used, largest = st.live_nbytes, st.largest_hole_nbytes
                else:
                    used = largest = 0
                tiers[tier.label] = TierStats(budget, used, copies, largest)
            room = {"waits": self._room_waits, "wait_s": self._room_wait_total_s,
                    "compactions": {t.label: a.stats().compactions for t, a in self._arenas.items()},
                    "compaction_s": {t.label: a.stats().compaction_s for t, a in self._arenas.items()}}
            return {"tiers": tiers, "moves": self.moves.summary(), "room": room}

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """Save every move as a Chrome / Perfetto trace (JSON)."""
        self.moves.write_trace(path)

    def close(self) -> None:
        """Wait for the moves in flight, free every tier and remove the swap file. Raises the
        AIOError of the first move that failed (the others are logged) after freeing all.
        Calls from other threads meanwhile and later raise ValueError (closed)."""
        self._close()

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -------------------------------------------------------------------------------

    def _fast_tier(self, tier: Tier | str) -> Tier:
        tier = Tier.of(tier)
        if tier == Tier.NVME:
            raise ValueError("fetch/release/pin work on 'device' or 'host'; NVMe is not addressable")
        if tier not in self._arenas:
            raise ValueError(f"the store has no {tier.label} budget")
        return tier

    def _ready(self, entry: Entry, tier: Tier) -> bool:
        with self._lock:
            copy = entry.copies.get(tier)
            return copy is not None and copy.valid and copy.moves_done()


def _check_distance(key: str, distance: float) -> None:
    if not isinstance(distance, (int, float)) or math.isnan(distance):
        raise ValueError(f"next-use hint for {key!r} must be a number (a distance in fetches), got {distance!r}")
