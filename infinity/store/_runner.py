"""The store's one lock, and the loop that runs each step of a store call under it.

[Note: the store's lock] One reentrant lock, `Runner.lock`, guards the state of every part of a
store: the entries, their copies and the moves between them (`Copies`), each tier's memory and
eviction queues (`Tiers`), the clocks (`UseClock`). The parts' methods run with it held and
never take it, never wait for I/O, never block: `TensorStore` calls them inside a step given
to `Runner.run`, or inside `with runner.open()` where no step can need a wait. Only `Runner.run`
and `TensorStore` (a put waiting for its write, `flush`, `close`) wait, always without the lock.
Two leaf locks are taken after it or alone, never before it: `RoomWaits`' condition (threads
waiting for room) and `MoveLog`'s (the trace). Read without any lock: the budgets and the set of
tiers (fixed at construction), the swap file and the I/O engine (thread-safe themselves); so
`Tiers.fast` (a tier check) and `Tiers.write` (a piece of `put_chunks`) run without it, and so
does `Tiers.close`, once the store is closed and every move settled.

[Note: no waiting under the lock] A step never blocks on I/O (or on a CUDA copy). A step that
needs a move to finish first (a write-back before its source may be freed, a read before its
bytes may be used) raises `MustWait` before it changes anything a rerun would redo; `run` then
waits for that move without the lock, settles it under the lock, and runs the step again. A
step that needs room another thread's release may free raises `MustWaitForRoom` (see [Note:
room on a fragmented tier] in `_tiers`), and `run` waits for that the same way. So a thread
waiting for a slow write-back never stalls another thread's fetch of a resident tensor.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from infinity.errors import ClosedError
from infinity.store._entry import PendingMove
from infinity.store._room import MustWaitForRoom, RoomWaits

T = TypeVar("T")


class MustWait(Exception):
    """A step needs `move` to finish first; see [Note: no waiting under the lock]."""

    def __init__(self, move: PendingMove, *, quiet: bool = False) -> None:
        super().__init__(move)
        self.move = move
        self.quiet = quiet  # a failure of the move is logged, not raised (its bytes are discarded)


class Runner:
    """Runs steps under the store's lock, waiting between reruns without it; knows whether the
    store is closed."""

    def __init__(self, settle: Callable[[PendingMove, bool], None], room: RoomWaits) -> None:
        self.lock = threading.RLock()
        self.closed = False  # set once, by the store's close()
        self._settle = settle  # settle(move, quiet): record a finished move, under the lock
        self._room = room

    def run(self, step: Callable[[], T], timeout: float | None = None) -> T:
        """Run `step` under the lock until it returns; see [Note: no waiting under the lock].
        Raises ClosedError once the store is closed, AIOTimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._room.start_call()
        while True:
            room = None
            with self.lock:
                self.check_open()
                try:
                    return step()
                except MustWait as wait:
                    move, quiet = wait.move, wait.quiet
                except MustWaitForRoom as wait:
                    room = wait
            if room is not None:
                self._room.wait(room, deadline)
                continue
            move.wait_quietly(None if deadline is None else max(0.0, deadline - time.monotonic()))
            with self.lock:
                self._settle(move, quiet)

    @contextlib.contextmanager
    def open(self) -> Iterator[None]:
        """The lock, for a step that needs no wait; ClosedError if the store is closed."""
        with self.lock:
            self.check_open()
            yield

    def check_open(self) -> None:
        if self.closed:
            raise ClosedError("the TensorStore is closed")
