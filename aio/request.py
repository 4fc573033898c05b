"""One in-flight transfer between a buffer and a file range."""

from __future__ import annotations

import errno
import math
import os
import threading
from typing import TYPE_CHECKING, Any

from aio.errors import AIOError, AIOTimeoutError

if TYPE_CHECKING:
    from aio.handle import Handle


class Request:
    """The future of one read or write.

    The request holds its buffer alive until it completes; `wait()` returns the number of
    bytes moved or raises AIOError naming the file, the offset and length of the part that
    failed. After `wait()` returns (or raises anything but AIOTimeoutError) the buffer is free
    to reuse. Thread-safe: several threads may wait on one request.
    """

    __slots__ = ("op", "path", "offset", "nbytes", "_handle", "_native", "_buffer", "_file",
                 "_lock", "_outcome")

    def __init__(self, handle: Handle | None, native: Any, buffer: Any, file: Any, op: str,
                 path: str, offset: int, nbytes: int) -> None:
        self.op = op  # "read" | "write"
        self.path = path  # the file's name in messages (a path, or an open file's name)
        self.offset = offset  # file offset in bytes
        self.nbytes = nbytes
        self._handle = handle
        self._native = native  # struct inf_aio_request *, None once finished
        self._buffer = buffer  # keeps the memory alive while in flight
        self._file = file  # the OpenFile in use
        self._lock = threading.Lock()
        self._outcome: int | AIOError | None = None if native is not None else 0

    def done(self) -> bool:
        """True once the transfer has finished, successfully or not (never blocks). While
        another thread is in `wait()` (which holds the lock until the transfer ends) it says
        False: taking the lock would wait for the transfer, and a caller polling under a lock
        of its own (the store's) would stall every thread behind it."""
        if self._outcome is not None:
            return True
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._outcome is None and self._handle._native.done(self._native):
                self._finish(self._handle._native.wait(self._native, 0))
        finally:
            self._lock.release()
        return self._outcome is not None

    def wait(self, timeout: float | None = None) -> int:
        """Block until done; bytes transferred. Raises AIOError, or AIOTimeoutError on timeout."""
        if self._outcome is None:
            timeout_ns = -1 if timeout is None else max(0, math.ceil(timeout * 1e9))
            if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
                self._raise_timeout(timeout)
            try:
                if self._outcome is None:
                    status = self._handle._native.wait(self._native, timeout_ns)
                    if status is None:
                        self._raise_timeout(timeout)
                    self._finish(status)
            finally:
                self._lock.release()
        if isinstance(self._outcome, AIOError):
            raise self._outcome
        return self._outcome

    def _raise_timeout(self, timeout: float | None) -> None:
        raise AIOTimeoutError(
            errno.ETIMEDOUT, f"not done after {timeout} s; still in flight", self.path,
            op=self.op, offset=self.offset, nbytes=self.nbytes,
        )

    def _finish(self, status: Any) -> None:
        """Record the outcome and give the native request and the buffer back. Lock held."""
        handle = self._handle
        handle._native.free(self._native)
        self._native = None
        self._buffer = None
        self._outcome = status.nbytes_done if status.error == 0 else self._error(status)
        handle._finished(self)  # gives the file back: _error may still look at it

    def _error(self, status: Any) -> AIOError:
        message = os.strerror(status.error)
        if status.error == errno.ENODATA:
            try:
                size = os.fstat(self._file.buffered_fd).st_size
                message = (f"end of file: the file has {size} bytes, "
                           f"the read needs {self.offset + self.nbytes}")
            except OSError:
                message = "end of file before the read was satisfied"
        elif status.error == errno.ECANCELED:
            message = "cancelled: the handle was closed before this part ran"
        return AIOError(status.error, message, self.path, op=self.op,
                        offset=status.error_offset, nbytes=status.error_nbytes)

    def __repr__(self) -> str:
        state = "in flight" if self._outcome is None else "done"
        return (f"<aio.Request {self.op} {self.path!r} offset={self.offset} "
                f"nbytes={self.nbytes} {state}>")
