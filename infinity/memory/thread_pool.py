"""Worker threads made once and lent to native kernels call after call.

Kernels that spread one array over threads (CPU Adam, compaction moves) used to start and join
their threads on every call: ~40 us a call here, as much as updating 100k elements, and a
per-unit optimizer step makes thousands of calls a step. A `ThreadPool` holds `threads - 1`
sleeping workers; each kernel call runs on the calling thread plus as many workers as its size
warrants (see csrc/common/inf_pool.h). The owner closes it (or uses `with`); calls that share a
pool take turns on its workers, so give each concurrent caller its own pool to run side by side.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any

from infinity.errors import ClosedError
from infinity.memory._move import ffi, lib
from infinity.memory.usage import usable_cores


def _destroy(destroy: Callable[[Any], None], pool: Any, owner: int) -> None:
    """`destroy(pool)` in the process that made it: a child made by os.fork() has a copy of the
    pool but not its workers, and waiting for them to join would never end."""
    if os.getpid() == owner:
        destroy(pool)


class ThreadPool:
    """`threads - 1` persistent workers that join the calling thread inside native kernels.

    Args:
        threads: threads a kernel call may use, the calling one included (default: the cores
            this process may run on). 1 means no workers: kernels run on the calling thread.

    Raises ValueError for threads < 1, OSError when the workers cannot be started.
    """

    def __init__(self, threads: int | None = None) -> None:
        if threads is None:
            threads = usable_cores()
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1 or None, got {threads!r}")
        out = ffi.new("struct inf_pool **")
        ret = lib.inf_pool_create(threads, out)
        if ret < 0:
            raise OSError(-ret, f"cannot start {threads - 1} worker threads: {os.strerror(-ret)}")
        self.threads: int = threads
        self._pool = out[0]
        # A safety net for owners that never close: the workers are only sleeping threads.
        self._owner = os.getpid()
        self._finalizer = weakref.finalize(self, _destroy, lib.inf_pool_destroy, self._pool,
                                           self._owner)

    @property
    def address(self) -> int:
        """The native pool's address, for another native module (see [Note: one pool, two
        modules] in csrc/common/inf_pool.h). Raises ClosedError once closed."""
        return int(ffi.cast("uintptr_t", self.native))

    @property
    def native(self):  # cdata 'struct inf_pool *' of this module's ffi
        if os.getpid() != self._owner:
            raise ClosedError(f"ThreadPool of process {self._owner}, inherited through fork(): "
                              "make a new one in this process")
        if not self._finalizer.alive:
            raise ClosedError("ThreadPool is closed")
        return self._pool

    def close(self) -> None:
        """Stop and join the workers (idempotent). No kernel may be running on the pool."""
        self._finalizer()

    def __enter__(self) -> ThreadPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "open" if self._finalizer.alive else "closed"
        return f"ThreadPool(threads={self.threads}, {state})"
