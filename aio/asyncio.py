"""Awaitable reads and writes for asyncio programs.

With a `handle`, the transfer runs on the native engine and the event loop waits for it in a
worker thread, so the loop never blocks. Without one (or for objects the engine cannot address)
the file is read or written through aiofiles, buffered: aiofiles comes with the `asyncio` extra
(`pip install 'infinity-offload[asyncio]'`), and only that path needs it.
"""

from __future__ import annotations

import asyncio
import errno
import os
from typing import Any

from aio.buffers import byte_view
from aio.errors import AIOError
from aio.handle import Handle


async def read(path: str | os.PathLike[str], buffer: Any, offset: int = 0, *,
               handle: Handle | None = None) -> int:
    """Fill `buffer` from `path` at `offset`; bytes read. Raises AIOError (ENODATA at end of file)."""
    if handle is not None:
        request = handle.read(buffer, path, offset)
        return await asyncio.get_running_loop().run_in_executor(None, request.wait)
    view = byte_view(buffer)
    if not view.flags.writeable:
        raise ValueError(f"cannot read into a read-only {type(buffer).__name__}")
    path = os.fspath(path)
    try:
        async with _aiofiles().open(path, "rb", buffering=0) as f:
            await f.seek(offset)
            data = await f.read(view.nbytes)
    except OSError as exc:
        raise AIOError(exc.errno or errno.EIO, exc.strerror, path, op="read", offset=offset,
                       nbytes=view.nbytes) from None
    view[: len(data)] = memoryview(data)
    if len(data) < view.nbytes:
        raise AIOError(errno.ENODATA, f"end of file: the read needs {offset + view.nbytes} bytes",
                       path, op="read", offset=offset + len(data), nbytes=view.nbytes - len(data))
    return len(data)


async def write(path: str | os.PathLike[str], buffer: Any, offset: int = 0, *,
                handle: Handle | None = None) -> int:
    """Write `buffer` to `path` at `offset` (created if missing, never truncated); bytes written."""
    if handle is not None:
        request = handle.write(buffer, path, offset)
        return await asyncio.get_running_loop().run_in_executor(None, request.wait)
    view = byte_view(buffer)
    path = os.fspath(path)
    try:
        async with _aiofiles().open(path, "r+b", buffering=0, opener=_open_for_update) as f:
            await f.seek(offset)
            done = 0
            while done < view.nbytes:  # raw files may write short; resume
                done += await f.write(memoryview(view)[done:])
            await f.flush()
    except OSError as exc:
        raise AIOError(exc.errno or errno.EIO, exc.strerror, path, op="write", offset=offset,
                       nbytes=view.nbytes) from None
    return done


def _aiofiles() -> Any:
    """The aiofiles module, or ImportError naming the extra that installs it."""
    try:
        import aiofiles
    except ImportError:
        raise ImportError("aio.asyncio without a handle needs aiofiles: pip install "
                          "'infinity-offload[asyncio]' (or pass handle=aio.Handle())") from None
    return aiofiles


def _open_for_update(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_CREAT, 0o666)
