"""A fixed set of aligned staging buffers for I/O, with back-pressure instead of allocation.

Reads from and writes to files go through page-aligned (optionally pinned) buffers. The pool
allocates them once, as one region; when all are on loan, ``acquire`` blocks until one comes
back, which throttles producers to the speed of the consumers. A tensor larger than one buffer
is moved in buffer-sized chunks (:meth:`BufferPool.copy_out`, :meth:`BufferPool.copy_in`,
:func:`iter_chunks`), so no buffer has to hold the largest tensor.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch

from aio.buffers import PAGE_NBYTES
from infinity.memory._backing import (
    Backing,
    is_power_of_two,
    resolve_device,
    round_up,
)

logger = logging.getLogger(__name__)


class Chunk(NamedTuple):
    """One piece of a larger transfer."""

    offset: int  # bytes from the start of the whole transfer
    nbytes: int  # length of this piece, at most the buffer size


def iter_chunks(total_nbytes: int, chunk_nbytes: int) -> Iterator[Chunk]:
    """Split ``total_nbytes`` into consecutive pieces of ``chunk_nbytes`` (the last may be short)."""
    if total_nbytes < 0:
        raise ValueError(f"total_nbytes={total_nbytes} must be >= 0")
    if chunk_nbytes <= 0:
        raise ValueError(f"chunk_nbytes={chunk_nbytes} must be > 0")
    for offset in range(0, total_nbytes, chunk_nbytes):
        yield Chunk(offset, min(chunk_nbytes, total_nbytes - offset))


@dataclass(slots=True)
class BufferPoolStats:
    """Occupancy and back-pressure counters of a pool."""

    count: int
    nbytes: int  # size of each buffer
    in_use: int
    acquisitions: int
    waits: int  # acquisitions that found no free buffer and had to block
    wait_s: float  # total time spent blocked in acquire


class PooledBuffer:
    """One buffer on loan; give it back with ``release()`` or by leaving a ``with`` block.

    Attributes:
        tensor: the buffer's bytes (1D, uint8, ``nbytes`` long, aligned). Owned by the pool:
            do not keep it, or views of it, after release.
        index: which of the pool's buffers this is.
    """

    __slots__ = ("tensor", "index", "_pool", "_held")

    def __init__(self, pool: BufferPool, index: int, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor = tensor
        self.index: int = index
        self._pool = pool
        self._held = True

    def release(self) -> None:
        """Return the buffer to its pool (same as ``pool.release(self)``)."""
        self._pool.release(self)

    def __enter__(self) -> PooledBuffer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "held" if self._held else "released"
        return f"PooledBuffer(index={self.index}, nbytes={self.tensor.numel()}, {state})"


def _as_bytes(tensor: torch.Tensor, role: str) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError(
            f"{role} of shape={tuple(tensor.shape)} stride={tensor.stride()} is not contiguous; "
            "pass tensor.contiguous()"
        )
    return tensor.reshape(-1).view(torch.uint8)


class BufferPool:
    """``count`` aligned buffers of ``nbytes`` bytes each, allocated once.

    Thread safety: ``acquire`` and ``release`` may be called from any thread; a buffer on
    loan belongs to its holder alone.

    Args:
        count: number of buffers; the bound on transfers in flight.
        nbytes: size of each buffer in bytes.
        device: ``"cpu"`` (the usual case, for file I/O) or ``"cuda[:N]"``.
        pinned: register host buffers with ``cudaHostRegister`` when CUDA is present.
        alignment: each buffer starts on a multiple of this (a power of two; default a page,
            as O_DIRECT requires).
    """

    def __init__(
        self,
        count: int,
        nbytes: int,
        *,
        device: str | torch.device = "cpu",
        pinned: bool = True,
        alignment: int = PAGE_NBYTES,
    ) -> None:
        if not isinstance(count, int) or count <= 0:
            raise ValueError(f"BufferPool count={count!r} must be a positive int")
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"BufferPool nbytes={nbytes!r} must be a positive int")
        if not is_power_of_two(alignment):
            raise ValueError(f"BufferPool alignment={alignment!r} must be a power of two")
        self.count: int = count
        self.nbytes: int = nbytes
        self.device: torch.device = resolve_device(device)
        stride = round_up(nbytes, alignment)
        self._backing = Backing(stride * count, self.device, pinned=pinned, alignment=alignment)
        self._buffers: list[torch.Tensor] = [  # each 1D uint8, aligned
            self._backing.tensor[i * stride : i * stride + nbytes] for i in range(count)
        ]
        self._cond = threading.Condition(threading.Lock())
        self._free: list[int] = list(range(count - 1, -1, -1))  # LIFO keeps hot buffers hot
        self._closed = False
        self._acquisitions = 0
        self._waits = 0
        self._wait_s = 0.0
        logger.info(
            "buffer pool of %d x %d bytes on %s (pinned=%s)",
            count,
            nbytes,
            self.device,
            self._backing.pinned,
        )

    @property
    def pinned(self) -> bool:
        """Whether the buffers are registered with CUDA."""
        return self._backing.pinned

    def acquire(self, timeout_s: float | None = None) -> PooledBuffer:
        """Take a free buffer, blocking while all are on loan.

        Args:
            timeout_s: give up after this many seconds (None waits forever, 0 does not wait).

        Raises:
            TimeoutError: no buffer came back in time; the message gives the pool's size.
        """
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"timeout_s={timeout_s} must be >= 0 or None")
        with self._cond:
            self._check_open()
            if not self._free:
                self._wait_for_free(timeout_s)
            index = self._free.pop()
            self._acquisitions += 1
            return PooledBuffer(self, index, self._buffers[index])

    def release(self, buf: PooledBuffer) -> None:
        """Return ``buf``; raises ValueError if it is foreign or was released already."""
        with self._cond:
            if not isinstance(buf, PooledBuffer) or buf._pool is not self:
                raise ValueError(f"{buf!r} does not belong to {self!r}")
            if not buf._held:
                raise ValueError(f"{buf!r} was released twice")
            buf._held = False
            self._free.append(buf.index)
            self._cond.notify()

    def chunks(self, nbytes: int) -> Iterator[Chunk]:
        """Pieces of a ``nbytes`` transfer that each fit in one buffer."""
        return iter_chunks(nbytes, self.nbytes)

    def copy_out(
        self,
        src: torch.Tensor,
        sink: Callable[[torch.Tensor, int], None],
        *,
        timeout_s: float | None = None,
    ) -> int:
        """Stage a contiguous tensor through the pool, one buffer-sized chunk at a time.

        ``sink(chunk, offset)`` receives each chunk (a uint8 view of a buffer) and the chunk's
        byte offset in ``src``; it must be done with the view when it returns, e.g. after a
        completed ``write``. Returns the bytes moved. Any tensor size works.
        """
        data = _as_bytes(src, "src")
        for offset, n in self.chunks(data.numel()):
            with self.acquire(timeout_s) as buf:
                piece = buf.tensor[:n]
                piece.copy_(data[offset : offset + n])
                sink(piece, offset)
        return data.numel()

    def copy_in(
        self,
        dst: torch.Tensor,
        source: Callable[[torch.Tensor, int], None],
        *,
        timeout_s: float | None = None,
    ) -> int:
        """Fill a contiguous tensor through the pool, one buffer-sized chunk at a time.

        ``source(chunk, offset)`` must fill the chunk (a uint8 view of a buffer) with the bytes
        that belong at ``offset`` in ``dst``, e.g. by a completed ``read``. Returns the bytes
        moved. Any tensor size works.
        """
        data = _as_bytes(dst, "dst")
        for offset, n in self.chunks(data.numel()):
            with self.acquire(timeout_s) as buf:
                piece = buf.tensor[:n]
                source(piece, offset)
                data[offset : offset + n].copy_(piece)
        return data.numel()

    def stats(self) -> BufferPoolStats:
        """A consistent snapshot of occupancy and waiting."""
        with self._cond:
            return BufferPoolStats(
                count=self.count,
                nbytes=self.nbytes,
                in_use=self.count - len(self._free),
                acquisitions=self._acquisitions,
                waits=self._waits,
                wait_s=self._wait_s,
            )

    def close(self) -> None:
        """Release the memory (unregistering it if pinned); later ``acquire`` calls raise."""
        with self._cond:
            if self._closed:
                return
            in_use = self.count - len(self._free)
            if in_use:
                logger.warning("%r closed with %d buffers still on loan", self, in_use)
            self._closed = True
            self._backing.close()
            self._cond.notify_all()

    def __enter__(self) -> BufferPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BufferPool(count={self.count}, nbytes={self.nbytes}, device={str(self.device)!r})"

    # - Internals; the caller holds self._cond.

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self!r} is closed")

    def _wait_for_free(self, timeout_s: float | None) -> None:
        self._waits += 1
        t0 = time.monotonic()
        deadline = None if timeout_s is None else t0 + timeout_s
        try:
            while not self._free:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"no buffer came back within {timeout_s} s: all {self.count} buffers "
                        f"of {self.nbytes} bytes in {self!r} are on loan; release them sooner "
                        "or make the pool larger"
                    )
                self._cond.wait(remaining)
                self._check_open()
        finally:
            self._wait_s += time.monotonic() - t0
