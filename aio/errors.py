"""Errors raised by aio: always an OSError subclass naming the file, the operation and the range."""

from __future__ import annotations

import errno as _errno
import os


class AIOError(OSError):
    """An I/O request failed.

    Built like OSError as ``AIOError(errno, strerror, path)``; also carries the operation and
    the byte range (``offset``, ``nbytes``) of the part that failed, and prints all of them.
    """

    def __init__(
        self,
        errno: int,
        strerror: str | None = None,
        path: str | os.PathLike[str] | None = None,
        *,
        op: str = "io",
        offset: int | None = None,
        nbytes: int | None = None,
    ) -> None:
        super().__init__(errno, strerror or os.strerror(errno), os.fspath(path) if path else None)
        self.op = op
        self.offset = offset
        self.nbytes = nbytes

    def __str__(self) -> str:
        where = f" at offset {self.offset}" if self.offset is not None else ""
        size = f" ({self.nbytes} bytes)" if self.nbytes is not None else ""
        name = _errno.errorcode.get(self.errno, str(self.errno))
        return f"{self.op} {self.filename!r}{where}{size} failed: [{name}] {self.strerror}"

    def __reduce__(self):
        return (_rebuild, (type(self), self.errno, self.strerror, self.filename, self.op,
                           self.offset, self.nbytes))


class AIOTimeoutError(AIOError, TimeoutError):
    """A wait ran past its timeout; the request may still be in flight and keeps its buffer."""


def _rebuild(cls, errno, strerror, path, op, offset, nbytes):
    return cls(errno, strerror, path, op=op, offset=offset, nbytes=nbytes)
