"""TensorStore: tensors by key across device / host / NVMe, under hard byte budgets.

An entry has a home (the slowest tier holding it) and may have faster copies that act as
caches. When a tier is full the store evicts a copy that is not in use nor pinned, in the order
of [Note: eviction order] (prefetched-unused last, farthest next use, idle before busy, least
recently used); the last current copy of a tensor that is evicted is first written down a tier.

The store is composed of parts with one job each, all guarded by one lock (see [Note: the
store's lock] in `_runner`):
- `Tiers` (`_tiers`): each tier's budget and memory, the copies placed on it, and making room
  (compaction, eviction order, waits for another thread's release);
- `Copies` (`_copies`): the entries by key, their copies, and the moves that fill them;
- `KeptVersions` (`_kept`): entries' bytes kept until a commit or a rollback;
- `UseClock` (`_hints`): the fetch clock of next-use hints and the touches of LRU; `MoveLog`
  (`moves`): what moved, for `stats()` and `write_trace`;
- `Runner` (`_runner`): the lock and the loop that runs each step under it, waiting between
  reruns without it.
TensorStore checks a call's arguments and runs its steps; TensorFuture runs the last one.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

import aio
from infinity.errors import BudgetError
from infinity.store._common import Tier
from infinity.store._copies import Copies
from infinity.store._entry import Entry, PendingMove
from infinity.store._hints import UseClock, check_distance
from infinity.store._kept import KeptVersions
from infinity.store._runner import Runner
from infinity.store._tiers import Tiers
from infinity.store.moves import MoveLog

logger = logging.getLogger(__name__)


class TensorFuture:
    """The result of a fetch: `result()` waits for the bytes and returns the tensor.

    Duck-compatible with concurrent.futures.Future for `result(timeout)` and `done()`.
    """

    __slots__ = ("_runner", "_copies", "_entry", "_tier", "_reads_only", "_tensor")

    def __init__(self, runner: Runner, copies: Copies, entry: Entry, tier: Tier, *,
                 reads_only: bool = False) -> None:
        self._runner = runner
        self._copies = copies
        self._entry = entry
        self._tier = tier
        self._reads_only = reads_only
        self._tensor: torch.Tensor | None = None

    def done(self) -> bool:
        if self._tensor is not None:
            return True
        with self._runner.lock:
            return self._copies.ready(self._entry, self._tier, reads_only=self._reads_only)

    def result(self, timeout: float | None = None) -> torch.Tensor:
        """The tensor on the fetched tier, valid until release(); see [Note: fetched tensors
        stay put] in `_copies`.

        Raises AIOTimeoutError after `timeout` seconds, or the AIOError of a failed read (a
        later call reads again); the fetch still counts as a use either way, so release() it.
        """
        if self._tensor is None:
            entry, tier, reads_only = self._entry, self._tier, self._reads_only
            self._tensor = self._runner.run(
                lambda: self._copies.fetched_tensor(entry, tier, reads_only=reads_only), timeout)
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
        rank: data-parallel rank, part of the swap file's name (used only where the file system
            cannot create it unlinked at once, see aio.SwapFile).
        keep_timeline: record every move for write_trace (counters are kept either way).
        checksum: record a crc32c of every tensor written to NVMe and check it on every read
            back; a mismatch (the swap file changed behind the store) is an AIOError naming
            the key, the file and the offset, and the read copy is not used. Off by default:
            it costs 10-20% of an optimizer step (docs/performance.md).
        room_wait_s: how long one call may wait for another thread to release a copy in use
            when a tier has no room for it otherwise (see [Note: room on a fragmented tier] in
            `_tiers`); a wait that cannot end (every holder waits too) raises BudgetError at once.

    The store has a clock, `clock`: the number of fetches so far. Next-use hints are distances
    on it: `set_next_use({key: d})` means "needed at the d-th fetch from now".

    Thread-safe. No call waits for I/O while holding the store's lock (see [Note: no waiting
    under the lock] in `_runner`), so a thread blocked on a slow write-back never stalls
    another's fetch of a resident tensor.
    """

    def __init__(self, budgets: Mapping[Tier | str, int], *,
                 nvme_path: str | os.PathLike[str] | None = None,
                 aio_handle: aio.Handle | None = None,
                 aio_options: Mapping[str, Any] | None = None,
                 device: str | torch.device | None = None, rank: int = 0,
                 keep_timeline: bool = True, checksum: bool = False,
                 room_wait_s: float = 30.0) -> None:
        budgets = {Tier.of(t): int(n) for t, n in budgets.items()}
        for tier, nbytes in budgets.items():
            if nbytes < 0:
                raise ValueError(f"budget for {tier.label} must be >= 0 bytes, got {nbytes}")
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if device.type != "cpu" and budgets.get(Tier.NVME) and not budgets.get(Tier.HOST):
            raise ValueError("NVMe <-> accelerator moves are staged in host memory: give the host "
                             "tier a budget")
        if not room_wait_s >= 0:
            raise ValueError(f"room_wait_s must be >= 0 seconds, got {room_wait_s!r}")
        self.budgets = budgets
        self.device = device
        self.checksum = checksum
        self.room_wait_s = room_wait_s
        self.moves = MoveLog(keep_timeline=keep_timeline)
        self._clock = UseClock()
        self._tiers = Tiers(budgets, device, self._clock, nvme_path=nvme_path, rank=rank,
                            aio_handle=aio_handle, aio_options=aio_options,
                            room_wait_s=room_wait_s)
        self._copies = Copies(self._tiers, self._clock, self.moves, device, checksum=checksum)
        self._versions = KeptVersions(self._copies, self._tiers)
        self._runner = Runner(self._copies.settle, self._tiers.room)

    @property
    def clock(self) -> int:
        """Fetches so far: the clock of next-use hints."""
        with self._runner.lock:
            return self._clock.fetches

    # -- public verbs --------------------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor, tier: Tier | str = Tier.NVME) -> None:
        """Store a copy of `tensor` under a new `key`, at home on `tier` (returns once stored)."""
        tier = Tier.of(tier)
        source = tensor.detach().to("cpu").contiguous() if tier == Tier.NVME else tensor.detach()
        with self._runner.lock:
            entry = self._copies.new_entry(key, tensor.shape, tensor.dtype)
        source_tier = Tier.HOST if tensor.device.type == "cpu" else Tier.DEVICE
        crc = aio.crc32c(source) if self.checksum and tier == Tier.NVME else None
        move: PendingMove | None = self._runner.run(
            lambda: self._copies.put(entry, tier, source, source_tier, crc))
        if move is None:
            return
        move.wait_quietly()
        with self._runner.open():  # closed: close() has settled the move and freed the tier
            self._copies.finish_put(entry, move)

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
        with self._runner.lock:
            entry = self._copies.new_entry(key, torch.Size(shape), dtype)
        copy = self._runner.run(lambda: self._copies.reserve_chunks(entry, tier))
        start, done, crc = self.moves.now(), 0, 0
        try:
            for chunk in chunks:
                piece = chunk.detach().reshape(-1)
                if piece.dtype != dtype or piece.device.type != "cpu":
                    raise ValueError(f"put_chunks({key!r}): a piece is {piece.dtype} on "
                                     f"{piece.device}, expected {dtype} on cpu")
                nbytes = piece.numel() * dtype.itemsize
                if done + nbytes > entry.nbytes:
                    raise ValueError(f"put_chunks({key!r}): pieces exceed {entry.nbytes} bytes")
                if tier == Tier.NVME:  # the copy is pinned: its extent stays; no lock needed
                    self._tiers.write(copy.extent, piece, at=done).wait()
                    if self.checksum:
                        crc = aio.crc32c(piece, crc)
                else:
                    with self._runner.lock:  # the arena may have moved the block (compaction)
                        flat = copy.block.tensor.view(-1)
                        flat[done // dtype.itemsize:][:piece.numel()].copy_(piece)
                done += nbytes
            if done != entry.nbytes:
                raise ValueError(f"put_chunks({key!r}): pieces gave {done} of {entry.nbytes} bytes")
        except BaseException:
            with self._runner.lock:
                self._copies.abandon_chunks(entry, copy, closed=self._runner.closed)
            raise
        with self._runner.open():
            self._copies.finish_chunks(entry, copy, crc if self.checksum and tier == Tier.NVME
                                       else None, start)

    def fetch(self, key: str, tier: Tier | str = Tier.HOST, *, next_use: float | None = None,
              overwrite: bool = False, wait: bool = True,
              reads_only: bool = False) -> TensorFuture:
        """Start bringing `key` to `tier` ("device" or "host"); the copy is in use until release().

        `next_use`: when it is needed again, as a distance on the store's clock from now
        (as in set_next_use). overwrite=True: the caller writes every element and releases
        dirty, so the value is not read in (where no copy on `tier` is current, the tensor's
        bytes are undefined); ValueError if the key is in use meanwhile. wait=False (a read
        ahead on a thread that computes): WouldWait, with nothing fetched, where making room
        would wait for a copy's I/O or another thread's release. reads_only=True: the holder
        never writes the tensor (and releases it clean), so it is handed out while a write-back
        from it is still running instead of after (the write reads the same bytes)."""
        tier = self._tiers.fast(tier)
        if next_use is not None:
            check_distance(key, next_use)

        def start() -> TensorFuture:
            entry = self._copies.entry(key)
            with contextlib.nullcontext() if wait else self._tiers.room_now_only():
                self._copies.start_use(entry, tier, next_use, overwrite=overwrite)
            return TensorFuture(self._runner, self._copies, entry, tier, reads_only=reads_only)

        return self._runner.run(start)

    @contextlib.contextmanager
    def hold(self, key: str, tier: Tier | str = Tier.HOST, *, dirty: bool = False,
             overwrite: bool = False, timeout: float | None = None) -> Iterator[torch.Tensor]:
        """`with store.hold(key) as tensor:` fetch `key` to `tier` and hand its tensor to the
        block; released on every path, the block's error (or the read's) going on.

        dirty=True: the block writes into the tensor. It is released dirty once its bytes were
        handed to the block, on an error too (the block may have changed part of them), and
        clean when the read itself failed (nothing was handed out, nothing changed).
        overwrite=True (dirty implied): the block writes every element, so the old value is
        not read (see `fetch`); after an error in the block the key holds what it wrote.
        """
        dirty = dirty or overwrite
        future = self.fetch(key, tier, overwrite=overwrite)
        handed = False
        try:
            tensor = future.result(timeout)
            handed = True
            yield tensor
        finally:
            self.release(key, tier, dirty=dirty and handed)

    def prefetch(self, keys: Iterable[str], tier: Tier | str = Tier.HOST) -> list[str]:
        """Start bringing `keys` to `tier` without taking a use (a device prefetch stops on the
        host when there is one). Returns the keys started or found present or in flight; stops
        at the first key that does not fit without evicting a copy in use, pinned, or itself
        prefetched and not yet fetched (logged at debug level)."""
        tier = self._tiers.fast(tier)
        target = Tier.HOST if tier == Tier.DEVICE and Tier.HOST in self._tiers.arenas else tier
        def start(key: str) -> None:
            self._copies.prefetch(self._copies.entry(key), target)

        started = []
        for key in keys:
            try:
                self._runner.run(lambda: start(key))  # noqa: B023 (run at once)
            except BudgetError as exc:
                logger.debug("prefetch to %s stops at %r: %s", target.label, key, exc)
                break
            started.append(key)
        return started

    def release(self, key: str, tier: Tier | str = Tier.HOST, *, dirty: bool = False) -> None:
        """End a fetch. With dirty=True the tensor was modified: it is written down to its home
        (asynchronously) and copies on faster tiers are dropped. Waits (without the lock) for
        an earlier write-back of the same key to finish first, so writes land in order."""
        tier = self._tiers.fast(tier)

        def end() -> Entry:
            entry = self._copies.entry(key)
            self._copies.end_use(entry, tier, dirty=dirty)
            return entry

        entry = self._runner.run(end)
        if dirty:
            self._runner.run(lambda: self._copies.write_down(entry))

    def set_next_use(self, hints: Mapping[str, float]) -> None:
        """Tell the store when keys are needed next, as distances on its clock from now:
        {key: d} means at the d-th fetch from now. Smaller is sooner; the copy needed farthest
        away is evicted first."""
        for key, distance in hints.items():
            check_distance(key, distance)
        with self._runner.open():
            for key, distance in hints.items():
                entry = self._copies.entry(key)
                self._clock.hint(entry, distance)
                self._copies.refresh(entry)

    def pin(self, key: str, tier: Tier | str = Tier.HOST) -> None:
        """Keep `key` resident on `tier` (fetching it if needed) until unpin()."""
        tier = self._tiers.fast(tier)

        def start() -> Entry:
            entry = self._copies.entry(key)
            self._copies.pin(entry, tier)
            return entry

        entry = self._runner.run(start)
        self._runner.run(lambda: self._copies.fetched_tensor(entry, tier))

    def unpin(self, key: str, tier: Tier | str = Tier.HOST) -> None:
        tier = self._tiers.fast(tier)
        with self._runner.open():
            self._copies.unpin(self._copies.entry(key), tier)

    def evict(self, key: str, tier: Tier | str) -> None:
        """Drop the copy of `key` on `tier` now; the last valid copy is first written down a
        tier (waiting for that write, without the lock)."""
        tier = Tier.of(tier)
        self._runner.run(lambda: self._copies.evict_idle(self._copies.entry(key), tier))

    def drop(self, key: str) -> None:
        """Forget `key` and free its space on every tier (waiting for its moves, without the
        lock)."""
        self._runner.run(lambda: self._copies.drop(self._copies.entry(key)))

    def keep(self, key: str) -> None:
        """Hold `key`'s current bytes as they are until `commit(key)` or `rollback(key)`, while
        the entry is used and changed as always: on NVMe its extent, the entry's next write-back
        going to a fresh one (no I/O now); at home in memory a copy of its block. Waits (without
        the lock) for a write-back of the key still running, raising its AIOError. BudgetError:
        the home tier has no room for the second copy (nothing is kept). ValueError: already
        kept. See [Note: kept versions] in `_kept`."""
        self._runner.run(lambda: self._versions.keep(self._copies.entry(key)))

    def commit(self, key: str) -> None:
        """Let `key`'s kept bytes go (no I/O). ValueError: nothing kept (committed twice)."""
        with self._runner.open():
            self._versions.commit(self._copies.entry(key))

    def rollback(self, key: str) -> None:
        """Make `key`'s kept bytes its value again and drop every copy changed since (no
        I/O; a write-back still running into one is waited for, without the lock, and its
        failure only logged). ValueError: nothing kept, or the key in use or pinned."""
        self._runner.run(lambda: self._versions.rollback(self._copies.entry(key)))

    def home(self, key: str) -> Tier:
        """The tier of `key`'s home copy (the slowest holding it)."""
        with self._runner.lock:
            return self._copies.entry(key).home

    def flush(self) -> None:
        """Wait for every move started before the call; raises the first I/O error."""
        with self._runner.open():
            moves = list(self._copies.moving)
        for move in moves:
            move.wait_quietly()
            with self._runner.lock:
                self._copies.settle(move)

    @property
    def nvme_directory(self) -> str | None:
        """The directory of the NVMe tier's swap file (None: no NVMe tier)."""
        swap = self._tiers.swap
        return swap.directory if swap is not None else None

    def __contains__(self, key: str) -> bool:
        with self._runner.lock:
            return key in self._copies.entries

    def tiers_of(self, key: str) -> list[str]:
        """Tiers holding a valid copy of `key`, fastest first."""
        with self._runner.lock:
            return [t.label for t in self._copies.current_tiers(self._copies.entry(key))]

    def unsaved(self, key: str) -> bool:
        """Whether a slower copy of `key` lacks changes a faster one holds because their
        write-back failed; the store keeps the faster copy (writing it down again before
        evicting it) and the caller may retry with fetch + release(dirty=True)."""
        with self._runner.lock:
            return self._copies.unsaved(self._copies.entry(key))

    def stats(self) -> dict[str, Any]:
        """Per-tier occupancy, per-direction move counters, "room": waits for another
        thread's release (count, seconds) and compactions per tier (count, seconds), and
        "kept": the entries with kept bytes (`keep`) and the bytes they hold besides."""
        with self._runner.lock:
            kept = [e.nbytes for e in self._copies.entries.values() if e.kept is not None]
            return {"tiers": self._tiers.stats(), "moves": self.moves.summary(),
                    "room": self._tiers.room_stats(),
                    "kept": {"entries": len(kept), "nbytes": sum(kept)}}

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """Save every move as a Chrome / Perfetto trace (JSON)."""
        self.moves.write_trace(path)

    def close(self) -> None:
        """Wait for the moves in flight, free every tier and remove the swap file. Raises the
        AIOError of the first move that failed (the others are logged) after freeing all.
        Calls from other threads meanwhile and later raise ClosedError (a ValueError)."""
        with self._runner.lock:
            if self._runner.closed:
                return
            self._runner.closed = True
            moves = [*self._copies.moving, *self._copies.putting.values()]
        self._tiers.room.changed()  # threads waiting for room find the store closed, not a deadline
        errors = []
        try:
            for move in moves:
                move.wait_quietly()
            with self._runner.lock:
                errors = self._copies.settle_all(moves)
        finally:
            self._tiers.close()
        for error in errors[1:]:
            logger.error("at close: %s (%s)", error, "; ".join(getattr(error, "__notes__", [])))
        if errors:
            raise errors[0]

    def __enter__(self) -> TensorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
