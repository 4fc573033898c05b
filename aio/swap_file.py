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
import weakref
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

    [Note: unlinked swap files] The file is created without a name in the directory of `path`
    (O_TMPFILE; where the file system lacks it, created as `path` and unlinked at once), and
    only its descriptor keeps it: when the process ends, however it ends (SIGKILL, the OOM
    killer), the kernel frees the space. Nothing is left behind to clean up. Messages name the
    directory and say the file is unlinked; `path` (/proc/self/fd/N) reopens the file from this
    process while it is open, and handles reach it through `fileno()`.

    Creation fails (AIOError with ENOSPC, EFBIG, EACCES, ...) when the space cannot be had, so
    a full disk is found at start-up, never in the middle of training. close() frees the space.
    Allocation is thread-safe.
    """

    def __init__(self, path: str | os.PathLike[str], nbytes: int, *,
                 alignment: int | None = None) -> None:
        if nbytes <= 0:
            raise ValueError(f"swap file size must be > 0 bytes, got {nbytes}")
        self.directory = os.path.dirname(os.path.abspath(os.fspath(path)))
        self.name = f"{self.directory} (unlinked swap file)"  # what messages call it
        if not os.path.isdir(self.directory):
            raise AIOError(errno.ENOENT, "the directory does not exist", self.directory,
                           op="create swap file")
        self._fd = self._create(os.fspath(path), nbytes)
        try:
            found = _native.dio_alignment(self._fd)
            alignment = alignment or max(PAGE_NBYTES, found[1] if found else PAGE_NBYTES)
            if alignment & (alignment - 1):
                raise ValueError(f"alignment must be a power of two, got {alignment}")
        except BaseException:
            os.close(self._fd)
            raise
        self.path = f"/proc/self/fd/{self._fd}"
        self.alignment = alignment
        self.nbytes = nbytes - nbytes % alignment
        self._lock = threading.Lock()
        self._free = FreeList(self.nbytes)
        self._live: dict[int, Extent] = {}
        self._handles: weakref.WeakSet[Handle] = weakref.WeakSet()  # to forget() us at close
        self._closed = False

    def _create(self, path: str, nbytes: int) -> int:
        free = _free_bytes(self.directory)
        if free is not None and free < nbytes:
            raise AIOError(errno.ENOSPC,
                           f"needs {nbytes} bytes but the file system has {free} free",
                           self.name, op="create swap file", nbytes=nbytes)
        try:
            fd = _open_unlinked(self.directory, path)
        except OSError as exc:
            raise AIOError(exc.errno or errno.EIO, exc.strerror, self.name,
                           op="create swap file") from None
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as exc:
            os.close(fd)
            hint = " (file size limit, see ulimit -f)" if exc.errno == errno.EFBIG else ""
            raise AIOError(exc.errno or errno.EIO, f"cannot preallocate: {exc.strerror}{hint}",
                           self.name, op="create swap file", nbytes=nbytes) from None
        return fd

    def fileno(self) -> int:
        """The descriptor that keeps the file; ValueError once closed."""
        self._check_open()
        return self._fd

    # -- extents ------------------------------------------------------------------------------

    def allocate(self, nbytes: int) -> Extent:
        """Reserve an aligned extent for `nbytes` (best fit).

        Raises AIOError(ENOSPC) if no hole fits.
        """
        if nbytes < 0:
            raise ValueError(f"extent size must be >= 0, got {nbytes}")
        capacity = max(self.alignment, -(-nbytes // self.alignment) * self.alignment)
        with self._lock:
            self._check_open()
            offset = self._free.take(capacity)
            if offset is None:
                raise AIOError(errno.ENOSPC,
                               f"swap file full: asked {capacity} bytes, largest hole "
                               f"{self._free.largest_nbytes}, {self._free.free_nbytes} free "
                               f"of {self.nbytes}",
                               self.name, op="allocate", nbytes=nbytes)
            extent = Extent(offset, nbytes, capacity)
            self._live[offset] = extent
            return extent

    def free(self, extent: Extent) -> None:
        """Give an extent back; its neighbours' holes merge with it."""
        with self._lock:
            if self._live.get(extent.offset) != extent:
                raise ValueError(f"{extent} is not a live extent of {self.name} (freed twice?)")
            del self._live[extent.offset]
            self._free.give(extent.offset, extent.capacity)

    def free_nbytes(self) -> int:
        return self._free.free_nbytes

    def largest_hole_nbytes(self) -> int:
        """The largest extent that allocate() can hand out now."""
        return self._free.largest_nbytes

    # -- I/O ----------------------------------------------------------------------------------

    def write(self, handle: Handle, extent: Extent, buffer: Any, *, at: int = 0) -> Request:
        """Start writing `buffer` into the extent, `at` bytes from its start (pieces of one
        tensor written in turn; an `at` that is a multiple of `alignment` keeps them direct)."""
        self._check_fits(extent, buffer, at)
        self._handles.add(handle)
        return handle.write(buffer, self, extent.offset + at)

    def read(self, handle: Handle, extent: Extent, buffer: Any) -> Request:
        """Start reading the extent's first len(buffer) bytes into `buffer`."""
        self._check_fits(extent, buffer)
        self._handles.add(handle)
        return handle.read(buffer, self, extent.offset)

    def _check_fits(self, extent: Extent, buffer: Any, at: int = 0) -> None:
        self._check_open()
        if self._live.get(extent.offset) != extent:
            raise ValueError(f"{extent} is not a live extent of {self.name}")
        nbytes = raw_buffer(buffer, writable=False).nbytes
        if at < 0 or at + nbytes > extent.nbytes:
            raise ValueError(f"buffer of {nbytes} bytes at {at} does not fit {extent}")

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError(f"swap file {self.name} is closed")

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Free the file's space: the handles it was used with close their descriptors to it,
        then its own is closed. Requests on it must be finished. Idempotent."""
        if not self._closed:
            for handle in list(self._handles):
                handle.forget(self)  # a no-op on a closed handle: it closed its files already
            self._closed = True
            os.close(self._fd)

    def __enter__(self) -> SwapFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"aio.SwapFile({self.name!r}, nbytes={self.nbytes}, live extents={len(self._live)})"


def _open_unlinked(directory: str, path: str) -> int:
    """A new read-write file in `directory` that has no name (see [Note: unlinked swap files])."""
    flags = os.O_RDWR | os.O_CLOEXEC
    try:
        return os.open(directory, flags | os.O_TMPFILE | os.O_EXCL, 0o600)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    logger.info("%s: no O_TMPFILE here; creating %s and unlinking it at once", directory, path)
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)
    except OSError:
        os.close(fd)
        raise
    return fd


def _free_bytes(directory: str) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
