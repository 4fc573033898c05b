"""The I/O handle: many reads and writes in flight at once, each with its own Request."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

from aio import _native
from aio._files import FileLike, FileTable, locate
from aio.buffers import raw_buffer
from aio.errors import AIOError, AIOTimeoutError
from aio.faults import Fault
from aio.request import Request

logger = logging.getLogger(__name__)

BACKENDS = ("io_uring", "libaio", "threads")
_auto_choice: str | None = None
_open_handles: weakref.WeakSet[Handle] = weakref.WeakSet()


@atexit.register
def _close_open_handles() -> None:
    """Close, at interpreter exit, the handles nobody closed, while the modules they need still
    exist: a handle held by a module (or a cycle) that the interpreter tears down after this
    package would otherwise be collected with `_native` and `warnings` gone, and its __del__
    would print a traceback instead of waiting for its requests."""
    for handle in list(_open_handles):
        handle.close()


def available_backends() -> list[str]:
    """The backends this process may use, fastest first.

    io_uring may be forbidden, e.g. by seccomp.
    """
    return [name for name in BACKENDS if _native.probe(name) == 0]


def _resolve_backend(backend: str) -> str:
    global _auto_choice
    if backend == "auto":
        if _auto_choice is None:
            _auto_choice = available_backends()[0]
            logger.info("aio backend 'auto' picked %s", _auto_choice)
        return _auto_choice
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {BACKENDS}, got {backend!r}")
    ret = _native.probe(backend)
    if ret < 0:
        raise OSError(-ret, f"backend {backend!r} is unavailable here ({os.strerror(-ret)}); "
                      f"available: {available_backends()}")
    return backend


class Handle:
    """Asynchronous reads and writes between host buffers and files.

    Parameters
    ----------
    block_size: bytes per piece; a large request is cut into pieces of this size, a multiple
        of 4096 up to 1 GiB.
    queue_depth: pieces in flight per queue.
    threads: queues, each with its own kernel context (or thread pool) and progress thread.
    backend: "auto" (io_uring, else libaio, else threads), "io_uring", "libaio" or "threads".
    faults: injected faults for tests (see aio.Fault).

    Notes
    -----
    Files are opened on first use (O_DIRECT where the file system allows) and kept open until
    close() or forget(file). Pieces that are aligned to the file system's direct-I/O alignment
    (at least a page) go through O_DIRECT; unaligned heads, tails and buffers go through the
    page cache, so nothing is ever written short. Use `aligned_empty` buffers and aligned
    offsets for full speed. Thread-safe.
    """

    def __init__(self, block_size: int = 1 << 20, queue_depth: int = 32, threads: int = 1,
                 backend: str = "auto", *, faults: Iterable[Fault] = ()) -> None:
        for name, value in (("block_size", block_size), ("queue_depth", queue_depth),
                            ("threads", threads)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r}")
        if not (0 < block_size <= 1 << 30 and block_size % 4096 == 0):
            raise ValueError("block_size must be a multiple of 4096 bytes up to 1 GiB, "
                             f"got {block_size}")
        if not 0 < queue_depth <= 4096:
            raise ValueError(f"queue_depth must be in 1..4096, got {queue_depth}")
        if not 0 < threads <= 64:
            raise ValueError(f"threads must be in 1..64, got {threads}")
        self.backend = _resolve_backend(backend)
        self.block_size = block_size
        self.queue_depth = queue_depth
        self.threads = threads
        self._native = _native.NativeHandle(self.backend, block_size, queue_depth, threads)
        self._files = FileTable()
        self._lock = threading.Lock()  # guards _closed and _in_flight together
        self._close_lock = threading.Lock()  # a second close() waits for the first
        self._in_flight: set[Request] = set()
        self._closed = False
        self._owner = os.getpid()  # a child made by os.fork() gets the handle, not its threads
        _open_handles.add(self)
        for fault in faults:
            self.inject(fault)

    # -- requests -----------------------------------------------------------------------------

    def read(self, buffer: Any, file: FileLike, offset: int = 0) -> Request:
        """Start reading len(buffer) bytes of `file` at `offset` into `buffer`.

        `file` is a path, or an open file (anything with fileno(), e.g. a SwapFile, whose
        `name` messages use): the handle opens its own descriptors to it through
        /proc/self/fd, so it works on unlinked files; forget() closes them.
        """
        return self._submit("read", buffer, file, offset)

    def write(self, buffer: Any, file: FileLike, offset: int = 0) -> Request:
        """Start writing `buffer` to `file` at `offset` (a path is created, never truncated)."""
        return self._submit("write", buffer, file, offset)

    def _submit(self, op: str, buffer: Any, file: FileLike, offset: int) -> Request:
        path, name = locate(file)
        if not isinstance(offset, int) or offset < 0:
            raise ValueError(f"offset must be a non-negative int, got {offset!r}")
        raw = raw_buffer(buffer, writable=op == "read")
        if os.getpid() != self._owner:
            raise ValueError(f"I/O on an aio.Handle of process {self._owner}, inherited through "
                             "fork(): open a new aio.Handle in this process")
        if self._closed:
            raise ValueError("I/O on a closed aio.Handle")
        if raw.nbytes == 0:
            return Request(None, None, None, None, op, name, offset, 0)
        opened = self._files.acquire(path, writable=op == "write", name=name)
        # Submitting and recording the request under the lock that close() takes to set _closed:
        # a request is either refused or seen by close(), never lost between the two.
        with self._lock:
            if self._closed:
                self._files.release(opened)
                raise ValueError("I/O on a closed aio.Handle")
            try:
                native = self._native.submit(op, opened.target, raw.address, raw.nbytes, offset)
            except OSError as exc:
                self._files.release(opened)
                raise AIOError(exc.errno, exc.strerror, name, op=op, offset=offset,
                               nbytes=raw.nbytes) from None
            request = Request(self, native, raw.keepalive, opened, op, name, offset, raw.nbytes)
            self._in_flight.add(request)
        return request

    def _finished(self, request: Request) -> None:
        """Called by a Request once it is done."""
        self._files.release(request._file)
        with self._lock:
            self._in_flight.discard(request)

    def wait_all(self, timeout: float | None = None) -> int:
        """Wait for every request in flight; total bytes moved. Raises the first error met
        (after all have finished) or AIOTimeoutError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        total, first_error = 0, None
        with self._lock:
            pending = list(self._in_flight)
        for request in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                total += request.wait(left)
            except AIOTimeoutError:
                raise
            except AIOError as exc:
                first_error = first_error or exc
        if first_error:
            raise first_error
        return total

    def forget(self, file: FileLike) -> None:
        """Close the descriptors this handle keeps open for `file` (after the requests in flight
        on it finish); a later request reopens it. Call it before closing an unlinked file you
        gave as an open file, or its disk space stays in use until the handle closes."""
        self._files.forget(locate(file)[0])

    def inject(self, fault: Fault) -> None:
        """Install a fault (tests only): see aio.Fault."""
        self._native.add_fault(fault.op, fault.nth, fault.kind, fault.value)

    # -- lifetime -----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the engine: pieces not yet started (and injected hangs) fail with ECANCELED,
        pieces in flight are waited for, files are closed. Idempotent. In a process forked from
        the one that made the handle it only marks it closed: the engine is the parent's."""
        if os.getpid() != self._owner:  # forked: the parent's engine (and locks), not ours
            self._closed = True
            return
        with self._close_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True  # from here on _submit refuses, so _in_flight is complete
            _open_handles.discard(self)
            self._native.shutdown()
            with self._lock:
                pending = list(self._in_flight)
            for request in pending:  # every request is done after shutdown: settle each one
                # wait(), not done(): done() does not wait for a thread already in wait(), and
                # destroying the engine under that thread's free() would be a use after free
                with contextlib.suppress(AIOError):
                    request.wait()
            self._native.destroy()
            self._files.close()

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2)
            self.close()

    def __repr__(self) -> str:
        return (f"aio.Handle(backend={self.backend!r}, block_size={self.block_size}, "
                f"queue_depth={self.queue_depth}, threads={self.threads})")
