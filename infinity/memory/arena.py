"""A preallocated arena of aligned tensor blocks that defragments itself by compaction.

The engine sizes one arena per tier at start-up and never asks the system allocator again, so
memory use is flat and a plan that does not fit fails at start-up rather than mid-step.

[Note: blocks are handles]
A :class:`Block` names a range of the arena, not an address. When an allocation fits in the
total free space but in no single hole, the arena compacts: it slides every live block toward
the start, in address order (``compact(keep=...)`` leaves chosen blocks in place and slides
the others past them; ``compact(need=...)`` slides only the cheapest stretch that opens one
hole of that size). ``Block.tensor`` then returns a view at the new place; a raw view
taken from ``Block.tensor`` earlier is *stale* after any later ``alloc`` on the same arena (from
any thread): keep the block, not the view (the store never compacts under a copy in use).
Compaction must not overlap copies or I/O that are still in flight on arena memory (an async
host-to-device copy, an aio request); the caller waits for them before allocating.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from aio import FreeList
from infinity.errors import BudgetError, ClosedError
from infinity.memory._backing import Backing, is_power_of_two, resolve_device, round_up
from infinity.memory._move import move_down
from infinity.memory.thread_pool import ThreadPool

logger = logging.getLogger(__name__)

DEFAULT_ALIGNMENT = 256
_MIN_ALIGNMENT = 16  # the widest element (complex128) must start on its own size
_BOUNCE_NBYTES = 4 << 20  # device-only scratch for overlapping moves; see _move.py


@dataclass(slots=True)
class ArenaStats:
    """A snapshot of an arena's occupancy and of the work compaction has done.

    Sizes are in bytes and count aligned spans, so ``live_nbytes + free_nbytes ==
    capacity_nbytes``.
    """

    capacity_nbytes: int
    live_nbytes: int
    free_nbytes: int
    largest_hole_nbytes: int
    fragmentation: float  # 1 - largest_hole / free; 0.0 when nothing is free
    live_blocks: int
    allocations: int  # successful alloc calls since creation, zero-size included
    compactions: int
    moved_nbytes: int  # bytes copied by all compactions
    compaction_s: float  # wall time spent compacting


class Block:
    """A handle on an aligned range of an :class:`Arena`; see [Note: blocks are handles].

    Attributes:
        shape: shape of the tensor the block holds.
        dtype: element type of that tensor.
        nbytes: bytes the tensor needs (the arena reserves this rounded up to its alignment).
    """

    __slots__ = (
        "shape",
        "dtype",
        "nbytes",
        "_arena",
        "_offset",
        "_span",
        "_view",
        "_live",
    )

    def __init__(self, arena: Arena, shape: torch.Size, dtype: torch.dtype, nbytes: int) -> None:
        self.shape: torch.Size = shape
        self.dtype: torch.dtype = dtype
        self.nbytes: int = nbytes
        self._arena = arena
        self._offset = 0  # bytes from the arena's start; changes when the arena compacts
        self._span = 0  # nbytes rounded up to the arena's alignment
        self._view: torch.Tensor | None = None  # shape, dtype; built on use, dropped on moves
        self._live = False

    @property
    def tensor(self) -> torch.Tensor:
        """The block's memory as a ``shape``/``dtype`` tensor, valid until the next ``alloc``."""
        with self._arena._lock:
            if not self._live:
                raise ValueError(f"{self!r} was freed; its memory may belong to another block")
            return self._arena._view_of(self)

    @property
    def offset(self) -> int:
        """Current byte offset in the arena (aligned); changes when the arena compacts."""
        return self._offset

    def __repr__(self) -> str:
        state = f"offset={self._offset}" if self._live else "freed"
        return f"Block(shape={tuple(self.shape)}, dtype={self.dtype}, {state})"


def _as_shape(shape: int | Sequence[int]) -> torch.Size:
    dims = (shape,) if isinstance(shape, int) else tuple(shape)
    if not all(isinstance(d, int) and d >= 0 for d in dims):
        raise ValueError(f"shape={shape!r} must be a non-negative int or a sequence of them")
    return torch.Size(dims)


class Arena:
    """A fixed region of host or device memory handing out aligned tensor blocks.

    Allocation is best fit (the smallest hole that fits, lowest address among equals) and a
    free coalesces with the holes on both sides. A request that fits in the total free space
    but in no hole triggers a compaction (see [Note: blocks are handles]); one that does not
    fit even then raises :class:`~infinity.errors.BudgetError` with the stats. Nothing is ever
    allocated outside the arena, except a small scratch for moves: on a device a fixed buffer
    for overlapping ones, on the host a list of pieces that lives for one compaction (about 50
    bytes per move and per 64 KiB moved).

    Thread safety: every method takes one internal lock, so an arena may be shared by
    threads; a compaction runs under that lock and blocks the others while it copies. On the
    host it copies on up to ``torch.get_num_threads()`` threads, with the GIL released.

    Args:
        nbytes: capacity in bytes, rounded up to ``alignment``.
        device: ``"cpu"`` for host memory or ``"cuda[:N]"`` for device memory.
        pinned: register host memory with ``cudaHostRegister`` when CUDA is present, so
            copies to the device can be asynchronous; ignored without CUDA or on a device.
        alignment: every block starts on a multiple of this many bytes (a power of two,
            at least 16). The arena itself starts on a page (or ``alignment``) boundary.
    """

    def __init__(
        self,
        nbytes: int,
        device: str | torch.device = "cpu",
        pinned: bool = True,
        *,
        alignment: int = DEFAULT_ALIGNMENT,
    ) -> None:
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"Arena nbytes={nbytes!r} must be a non-negative int")
        if not is_power_of_two(alignment) or alignment < _MIN_ALIGNMENT:
            raise ValueError(
                f"Arena alignment={alignment} must be a power of two >= {_MIN_ALIGNMENT}"
            )
        self.device: torch.device = resolve_device(device)
        self.alignment: int = alignment
        self.capacity_nbytes: int = round_up(nbytes, alignment)
        self._backing = Backing(
            self.capacity_nbytes, self.device, pinned=pinned, alignment=alignment
        )
        self._base: torch.Tensor = self._backing.tensor  # 1D uint8, aligned
        # - Device moves of overlapping ranges bounce through this; the host uses memmove.
        self._scratch: torch.Tensor | None = None
        if self.device.type == "cuda":
            self._scratch = torch.empty(
                min(_BOUNCE_NBYTES, self.capacity_nbytes), dtype=torch.uint8, device=self.device
            )
        self._lock = threading.Lock()
        self._free = FreeList(self.capacity_nbytes)
        self._live: set[Block] = set()
        self._closed = False
        # - Counters reported by stats()
        self._allocations = 0
        self._compactions = 0
        self._moved_nbytes = 0
        self._compaction_s = 0.0
        logger.info(
            "arena of %d bytes on %s (alignment %d, pinned=%s)",
            self.capacity_nbytes,
            self.device,
            alignment,
            self._backing.pinned,
        )

    @property
    def pinned(self) -> bool:
        """Whether the arena's host memory is registered with CUDA."""
        return self._backing.pinned

    def alloc(self, shape: int | Sequence[int], dtype: torch.dtype) -> Block:
        """Reserve a block for a ``shape``/``dtype`` tensor; its contents are undefined.

        May compact the arena first, which moves other blocks (see [Note: blocks are handles]).
        Raises BudgetError, naming the request and the stats, when even a compaction would not
        make room.
        """
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"dtype={dtype!r} must be a torch.dtype")
        size = _as_shape(shape)
        nbytes = size.numel() * dtype.itemsize
        span = round_up(nbytes, self.alignment)
        with self._lock:
            self._check_open()
            block = Block(self, size, dtype, nbytes)
            if span:
                offset = self._free.take(span)
                if offset is None:
                    if span > self._free.free_nbytes:
                        raise BudgetError(
                            f"arena on {self.device} cannot hold shape={tuple(size)} "
                            f"dtype={dtype} ({nbytes} bytes, {span} aligned): only "
                            f"{self._free.free_nbytes} of {self.capacity_nbytes} bytes are free; "
                            f"free blocks or size the arena larger. {self._stats_locked()}"
                        )
                    self._compact_locked()
                    offset = self._free.take(span)
                    assert offset is not None, "one hole holds all free space after compaction"
                block._offset = offset
                block._span = span
            block._live = True
            self._live.add(block)
            self._allocations += 1
            return block

    def free(self, block: Block) -> None:
        """Give a block back; tensors bound to it are re-pointed to an empty placeholder.

        Raises ValueError for a block of another arena or one already freed.
        """
        with self._lock:
            self._check_owned(block)
            if not block._live:
                raise ValueError(f"double free of {block!r}")
            self._live.remove(block)
            block._live = False
            block._view = None
            if block._span:
                self._free.give(block._offset, block._span)

    def compact(self, keep: Collection[Block] = (), need: int | None = None) -> int:
        """Slide live blocks toward the start now; returns the bytes moved.

        ``alloc`` does this on its own when needed; calling it ahead of time moves the cost
        to a moment the caller chooses (between steps, with no I/O in flight). Blocks in
        ``keep`` stay where they are (a caller holds a view of them, or I/O targets them):
        the others slide down past them, each to the lowest place above the one before it
        that overlaps no kept block, so free space gathers in the holes the kept blocks
        leave and at the end (see [Note: blocks are handles]).

        With ``need`` (bytes), only the blocks of the cheapest stretch that makes a hole of at
        least ``need`` move ([Note: compacting just enough]), and none when no stretch between
        kept blocks holds that much free space (the caller may evict, or compact everything).
        """
        with self._lock:
            self._check_open()
            for block in keep:
                self._check_owned(block)
            return self._compact_locked(frozenset(b for b in keep if b._live and b._span), need)

    def stats(self) -> ArenaStats:
        """A consistent snapshot of occupancy and compaction counters."""
        with self._lock:
            return self._stats_locked()

    def close(self) -> None:
        """Release the memory (unregistering it if pinned); later ``alloc`` calls raise.

        Views still held elsewhere keep the memory alive, unpinned. Closing twice is a no-op.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._backing.close()
            self._scratch = None

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Arena(nbytes={self.capacity_nbytes}, device={str(self.device)!r})"

    # - Internals; the caller holds self._lock.

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"{self!r} is closed")

    def _check_owned(self, block: Block) -> None:
        if not isinstance(block, Block):
            raise ValueError(f"expected a Block, got {type(block).__name__}")
        if block._arena is not self:
            raise ValueError(f"{block!r} belongs to {block._arena!r}, not to {self!r}")

    def _view_of(self, block: Block) -> torch.Tensor:
        if block._view is None:
            start = block._offset
            raw = self._base[start : start + block.nbytes]
            block._view = raw.view(block.dtype).view(block.shape)
        return block._view

    def _compact_locked(self, keep: frozenset[Block] = frozenset(),
                        need: int | None = None) -> int:
        # Adjacent blocks that slide by one distance form a run, and each run is one move.
        # All moves are copied in one call (see _move.py), then the blocks learn where they are.
        # Targets ascend (a cursor) and never overlap a kept block, as move_down requires.
        t0 = time.perf_counter()
        live = sorted((b for b in self._live if b._span), key=lambda b: b._offset)
        kept = [b for b in live if b in keep]
        cursor = 0
        if need is not None:
            stretch = _cheapest_stretch(live, keep, need, self.capacity_nbytes)
            if stretch is None:
                return 0  # not a compaction: nothing moved
            live, cursor = stretch
            kept = []  # none lies among the stretch's blocks
        dst: list[int] = []
        src: list[int] = []
        nbytes: list[int] = []
        runs: list[tuple[list[Block], int]] = []  # (blocks, distance)
        k = 0  # first kept block that may lie at or above the cursor
        for block in live:
            if block in keep:
                continue
            place = cursor
            while k < len(kept) and kept[k]._offset + kept[k]._span <= place:
                k += 1
            while k < len(kept) and kept[k]._offset < place + block._span:
                place = kept[k]._offset + kept[k]._span  # it would overlap: go past it
                k += 1
            cursor = place + block._span
            distance = block._offset - place
            if not distance:
                continue
            last = runs[-1][0][-1] if runs else None
            if (last is not None and runs[-1][1] == distance
                    and last._offset + last._span == block._offset):
                runs[-1][0].append(block)
                nbytes[-1] = block._offset + block.nbytes - src[-1]  # the last padding stays
                continue
            dst.append(place)
            src.append(block._offset)
            nbytes.append(block.nbytes)
            runs.append(([block], distance))
        if dst:
            if self.device.type == "cpu":
                # Compactions are rare: workers for this one alone cost nothing worth keeping them.
                with ThreadPool(torch.get_num_threads()) as pool:
                    move_down(self._base, dst, src, nbytes, pool=pool)
            else:
                move_down(self._base, dst, src, nbytes, scratch=self._scratch)
        for blocks, distance in runs:
            for block in blocks:
                block._offset -= distance
                block._view = None
        self._rebuild_free_list()
        moved = sum(nbytes)
        elapsed = time.perf_counter() - t0
        self._compactions += 1
        self._moved_nbytes += moved
        self._compaction_s += elapsed
        logger.debug(
            "compaction %d moved %d bytes in %.6f s around %d kept blocks; %d bytes free, "
            "largest hole %d",
            self._compactions,
            moved,
            elapsed,
            len(kept),
            self._free.free_nbytes,
            self._free.largest_nbytes,
        )
        return moved

    def _rebuild_free_list(self) -> None:
        """The holes are the gaps between live blocks (after blocks moved)."""
        self._free.reset(self.capacity_nbytes)
        cursor = 0
        for block in sorted((b for b in self._live if b._span), key=lambda b: b._offset):
            if block._offset > cursor:
                self._free.give(cursor, block._offset - cursor)
            cursor = block._offset + block._span
        if cursor < self.capacity_nbytes:
            self._free.give(cursor, self.capacity_nbytes - cursor)

    def _stats_locked(self) -> ArenaStats:
        free = self._free.free_nbytes
        largest = self._free.largest_nbytes
        return ArenaStats(
            capacity_nbytes=self.capacity_nbytes,
            live_nbytes=self.capacity_nbytes - free,
            free_nbytes=free,
            largest_hole_nbytes=largest,
            fragmentation=1.0 - largest / free if free else 0.0,
            live_blocks=len(self._live),
            allocations=self._allocations,
            compactions=self._compactions,
            moved_nbytes=self._moved_nbytes,
            compaction_s=self._compaction_s,
        )


def _cheapest_stretch(live: list[Block], keep: frozenset[Block], need: int,
                      capacity: int) -> tuple[list[Block], int] | None:
    """[Note: compacting just enough] Consecutive blocks b_i..b_j (by address, none kept) slid
    down to the end of the block before them (or the arena's start) leave one hole of the
    free bytes between that end and the start of the block after them (or the arena's end).
    Among the stretches whose hole would hold `need` bytes, the one with the fewest bytes to
    move: (its blocks, where the first one goes), or None when none would. A full compaction
    moves every block above the first hole, so an arena holding many blocks pays a copy of most
    of itself per request (the store's host tier 400 MB larger than the plan's on the 294M GPT:
    ~84 MB a compaction). Two pointers over each run of movable blocks between kept ones."""
    best: tuple[int, list[Block], int] | None = None
    start = 0
    while start < len(live):
        end = start
        while end < len(live) and live[end] not in keep:
            end += 1
        lo = live[start - 1]._offset + live[start - 1]._span if start else 0
        hi = live[end]._offset if end < len(live) else capacity
        run = live[start:end]
        # free(i, j): bytes of [edge below run[i], edge above run[j - 1]) not in run[i:j]
        below = [lo] + [b._offset + b._span for b in run]  # below[i]: the end before run[i]
        above = [b._offset for b in run] + [hi]  # above[j]: the start after run[j - 1]
        moved, j = 0, 0
        for i in range(len(run)):
            if j < i:
                j, moved = i, 0
            while j < len(run) and above[j] - below[i] - moved < need:
                moved += run[j]._span
                j += 1
            if j > i and above[j] - below[i] - moved >= need and (best is None or
                                                                   moved < best[0]):
                best = (moved, run[i:j], below[i])
            if j > i:
                moved -= run[i]._span
        start = end + 1
    return None if best is None else (best[1], best[2])
