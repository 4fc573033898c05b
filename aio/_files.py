"""Open files as the engine needs them: an O_DIRECT and a buffered descriptor, plus alignment.

A file is named by its path or given as an open file (anything with `fileno()`, such as an
unlinked SwapFile): the engine then opens its own descriptors through /proc/self/fd/N, which
reaches the file even when it has no name left. Descriptors are cached per path and checked
against the path's inode on every use, so a file replaced or removed behind the handle's back is
reopened rather than written through a stale descriptor. A descriptor still used by a request in
flight is closed only after it completes.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

from aio import _native
from aio.buffers import PAGE_NBYTES
from aio.errors import AIOError

logger = logging.getLogger(__name__)

MAX_CACHED_FILES = 256
_warned_devices: set[int] = set()


class HasFileno(Protocol):
    """An open file: a descriptor and, optionally, a name for messages."""

    def fileno(self) -> int: ...


FileLike = str | os.PathLike[str] | HasFileno


def locate(file: FileLike) -> tuple[str, str]:
    """(path that opens `file`, name for messages) for a path or an open file."""
    if isinstance(file, (str, os.PathLike)):
        path = os.fspath(file)
        return path, path
    if not hasattr(file, "fileno"):
        raise TypeError(f"expected a path or an open file (with fileno()), got {type(file).__name__}")
    fd = file.fileno()
    return f"/proc/self/fd/{fd}", str(getattr(file, "name", f"file descriptor {fd}"))


@dataclass(slots=True)
class OpenFile:
    """One path opened for the engine; `users` counts requests in flight on it."""

    path: str  # what opens the file (for a file given open: /proc/self/fd/N)
    name: str  # what messages call it
    writable: bool
    direct_fd: int  # -1 where the file system refuses O_DIRECT
    buffered_fd: int
    mem_align: int  # O_DIRECT buffer address alignment
    direct_align: int  # O_DIRECT offset/length alignment, at least a page
    identity: tuple[int, int]  # (st_dev, st_ino) when opened
    target: Any = field(repr=False)  # struct inf_aio_target handed to the engine
    users: int = 0
    retired: bool = False

    def close(self) -> None:
        for fd in {self.direct_fd, self.buffered_fd} - {-1}:
            os.close(fd)


def _open_error(exc: OSError, name: str, op: str) -> AIOError:
    return AIOError(exc.errno or errno.EIO, exc.strerror, name, op=f"open for {op}")


def open_file(path: str, writable: bool, name: str | None = None) -> OpenFile:
    """Open `path` for reading, or for writing (created if missing, never truncated); messages
    call it `name` (default: the path)."""
    name = name or path
    op = "write" if writable else "read"
    flags = (os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY) | os.O_CLOEXEC
    try:
        buffered_fd = os.open(path, flags, 0o666)
    except OSError as exc:
        raise _open_error(exc, name, op) from None
    try:
        st = os.fstat(buffered_fd)
        if not os.path.stat.S_ISREG(st.st_mode):
            raise AIOError(errno.EINVAL, "not a regular file", name, op=f"open for {op}")
        try:
            direct_fd = os.open(path, (flags & ~os.O_CREAT) | os.O_DIRECT)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise _open_error(exc, name, op) from None
            direct_fd = -1
            if st.st_dev not in _warned_devices:
                _warned_devices.add(st.st_dev)
                logger.warning(
                    "%s: the file system refuses O_DIRECT; using buffered I/O (through the page "
                    "cache, slower and uses RAM) for files on this device",
                    name,
                )
        alignment = _native.dio_alignment(direct_fd if direct_fd >= 0 else buffered_fd)
        mem_align, offset_align = alignment or (PAGE_NBYTES, PAGE_NBYTES)
        direct_align = max(offset_align, PAGE_NBYTES)
        mem_align = max(mem_align, 1)
    except BaseException:
        os.close(buffered_fd)
        raise
    target = _native.new_target(direct_fd, buffered_fd, mem_align, direct_align)
    return OpenFile(path, name, writable, direct_fd, buffered_fd, mem_align, direct_align,
                    (st.st_dev, st.st_ino), target)


def direct_io_supported(directory: str) -> bool:
    """Whether the engine opens files in `directory` with O_DIRECT (else reads may come from the
    page cache); probes with a file it creates and removes."""
    probe = os.path.join(directory, ".odirect-probe")
    try:
        opened = open_file(probe, writable=True)
        opened.close()
        return opened.direct_fd >= 0
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


class FileTable:
    """Cache of OpenFile by path. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._files: dict[str, OpenFile] = {}
        self._retired: list[OpenFile] = []

    def acquire(self, path: str, writable: bool, name: str | None = None) -> OpenFile:
        """The open file for `path`, counted as used until release()."""
        identity = None
        try:
            st = os.stat(path)
            identity = (st.st_dev, st.st_ino)
        except OSError as exc:
            if not writable or exc.errno != errno.ENOENT:
                raise _open_error(exc, name or path, "write" if writable else "read") from None
        with self._lock:
            cached = self._files.get(path)
            if cached and cached.identity == identity and (cached.writable or not writable):
                cached.users += 1
                return cached
        opened = open_file(path, writable, name)
        with self._lock:
            stale = self._files.pop(path, None)
            if stale:
                self._retire(stale)
            if len(self._files) >= MAX_CACHED_FILES:
                for key, idle in list(self._files.items()):
                    if idle.users == 0:
                        del self._files[key]
                        idle.close()
            self._files[path] = opened
            opened.users += 1
            return opened

    def release(self, opened: OpenFile) -> None:
        with self._lock:
            opened.users -= 1
            if opened.retired and opened.users == 0:
                self._retired.remove(opened)
                opened.close()

    def forget(self, path: str) -> None:
        """Close the descriptors kept for `path` (once no request in flight uses them)."""
        with self._lock:
            opened = self._files.pop(path, None)
            if opened:
                self._retire(opened)

    def _retire(self, opened: OpenFile) -> None:
        if opened.users == 0:
            opened.close()
        else:
            opened.retired = True
            self._retired.append(opened)

    def close(self) -> None:
        """Close every descriptor; call only when no request is in flight."""
        with self._lock:
            for opened in [*self._files.values(), *self._retired]:
                opened.close()
            self._files.clear()
            self._retired.clear()
