"""One preallocated file carved into aligned extents: where swapped tensors live on NVMe.

[Note: swap extent alignment] Every extent starts on a multiple of `alignment` (at least a page
and at least the file system's O_DIRECT alignment) and reserves a whole number of alignments,
so transfers of a tensor into its extent go through O_DIRECT, and no two extents share a page.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from aio import _native
from aio.buffers import PAGE_NBYTES, raw_buffer
from aio.errors import AIOError
from aio.free_list import FreeList
from aio.handle import Handle
from aio.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Extent:
    """A byte range of a swap file owned by one tensor."""

    offset: int  # bytes from the start of the file, aligned
    nbytes: int  # bytes asked for
    capacity: int  # bytes reserved: nbytes rounded up to the alignment


class SwapFile:
    """A file of `nbytes`, allocated on disk at creation, handing out aligned extents.

    Creation fails (AIOError with ENOSPC, EFBIG, EACCES, ...) when the space cannot be had, so
    a full disk is found at start-up, never in the middle of training. The file is removed by
    close(). Allocation is thread-safe.
    """

    def __init__(self, path: str | os.PathLike[str], nbytes: int, *, alignment: int | None = None) -> None:
        self.path = os.fspath(path)
        if nbytes <= 0:
            raise ValueError(f"swap file size must be > 0 bytes, got {nbytes}")
        directory = os.path.dirname(os.path.abspath(self.path))
        if not os.path.isdir(directory):
            raise AIOError(errno.ENOENT, "the directory does not exist", directory, op="create swap file")
        fd = self._create(nbytes)
        try:
            found = _native.dio_alignment(fd)
            alignment = alignment or max(PAGE_NBYTES, found[1] if found else PAGE_NBYTES)
            if alignment & (alignment - 1):
                raise ValueError(f"alignment must be a power of two, got {alignment}")
        finally:
            os.close(fd)
        self.alignment = alignment
        self.nbytes = nbytes - nbytes % alignment
        self._lock = threading.Lock()
        self._free = FreeList(self.nbytes)
        self._live: dict[int, Extent] = {}
        self._closed = False

    def _create(self, nbytes: int) -> int:
        free = _free_bytes(os.path.dirname(os.path.abspath(self.path)))
        if free is not None and free < nbytes:
            raise AIOError(errno.ENOSPC, f"needs {nbytes} bytes but the file system has {free} free",
                           self.path, op="create swap file", nbytes=nbytes)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise AIOError(exc.errno or errno.EIO, exc.strerror, self.path, op="create swap file") from None
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            os.unlink(self.path)
            hint = " (file size limit, see ulimit -f)" if exc.errno == errno.EFBIG else ""
            raise AIOError(exc.errno or errno.EIO, f"cannot preallocate: {exc.strerror}{hint}",
                           self.path, op="create swap file", nbytes=nbytes) from None
        return fd

    # -- extents ------------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> Extent:
        """Reserve an aligned extent for `nbytes` (best fit). Raises AIOError(ENOSPC) if no hole fits."""
        if nbytes < 0:
            raise ValueError(f"extent size must be >= 0, got {nbytes}")
        capacity = max(self.alignment, -(-nbytes // self.alignment) * self.alignment)
        with self._lock:
            self._check_open()
            offset = self._free.take(capacity)
            if offset is None:
                raise AIOError(errno.ENOSPC,
                               f"swap file full: asked {capacity} bytes, largest hole "
                               f"{self._free.largest_nbytes}, {self._free.free_nbytes} free of {self.nbytes}",
                               self.path, op="allocate", nbytes=nbytes)
            extent = Extent(offset, nbytes, capacity)
            self._live[offset] = extent
            return extent

    def free(self, extent: Extent) -> None:
        """Give an extent back; its neighbours' holes merge with it."""
        with self._lock:
            if self._live.get(extent.offset) != extent:
                raise ValueError(f"{extent} is not a live extent of {self.path} (freed twice?)")
            del self._live[extent.offset]
            self._free.give(extent.offset, extent.capacity)

    def free_nbytes(self) -> int:
        return self._free.free_nbytes

    def largest_hole_nbytes(self) -> int:
        """The largest extent that allocate() can hand out now."""
        return self._free.largest_nbytes

    # -- I/O ----------------------------------------------------------------------------------

    def write(self, handle: Handle, extent: Extent, buffer: Any) -> Request:
        """Start writing `buffer` (at most extent.nbytes) into the extent."""
        self._check_fits(extent, buffer)
        return handle.write(buffer, self.path, extent.offset)

    def read(self, handle: Handle, extent: Extent, buffer: Any) -> Request:
        """Start reading the extent's first len(buffer) bytes into `buffer`."""
        self._check_fits(extent, buffer)
        return handle.read(buffer, self.path, extent.offset)

    def _check_fits(self, extent: Extent, buffer: Any) -> None:
        self._check_open()
        if self._live.get(extent.offset) != extent:
            raise ValueError(f"{extent} is not a live extent of {self.path}")
        nbytes = raw_buffer(buffer, writable=False).nbytes
        if nbytes > extent.nbytes:
            raise ValueError(f"buffer of {nbytes} bytes does not fit {extent}")

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"swap file {self.path} is closed")

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Remove the file. Requests on it must be finished. Idempotent."""
        if not self._closed:
            self._closed = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> SwapFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"aio.SwapFile({self.path!r}, nbytes={self.nbytes}, live extents={len(self._live)})"


def _free_bytes(directory: str) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
