"""Threads waiting for another thread to release a copy in use, so that a full tier has room;
see [Note: room on a fragmented tier] in `_tiers`."""

from __future__ import annotations

import threading
import time


class MustWaitForRoom(Exception):
    """A step needs room that a use held by another thread may free. The calling thread is
    registered as waiting for room (`RoomWaits.must_wait`)."""

    def __init__(self, seen: int, deadline: float, since: float) -> None:
        super().__init__(seen)
        self.seen = seen  # the room counter when the step gave up: wait for it to change
        self.deadline = deadline  # monotonic time after which the step raises BudgetError
        self.since = since  # monotonic time the thread was registered as waiting


class _CallState(threading.local):
    """Per thread, per store call: when its waits for room end (None: it has not waited)."""

    room_deadline: float | None = None
    room_waited_from: float = 0.0


class RoomWaits:
    """Who waits for room, and a counter of the events that may make some (releases, frees,
    unpins, new waiters). Its condition is a leaf lock: taken after the store's lock or alone,
    never before it (see [Note: the store's lock] in `_runner`)."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s  # longest wait of one call for another thread's release
        self._cond = threading.Condition(threading.Lock())
        self._changes = 0
        self._waiting: set[int] = set()  # threads (get_ident) in a wait for room
        self._call = _CallState()
        self._waits = 0  # waits so far, and their seconds
        self._wait_total_s = 0.0

    def start_call(self) -> None:
        """A store call begins: it has not waited for room yet."""
        self._call.room_deadline = None

    def changed(self) -> None:
        """Room may have appeared: the threads waiting for it run their step again."""
        with self._cond:
            self._changes += 1
            self._cond.notify_all()

    def waiting(self) -> frozenset[int]:
        """The threads in a wait for room now."""
        with self._cond:
            return frozenset(self._waiting)

    def may_wait(self, now: float) -> bool:
        """Whether this call's time for waits has not run out (it starts at its first ask)."""
        call = self._call
        if call.room_deadline is None:
            call.room_waited_from = now
            return True
        return now < call.room_deadline

    def waited_s(self, now: float) -> float | None:
        """Seconds this call has spent in waits for room (None: it has not waited)."""
        call = self._call
        return None if call.room_deadline is None else now - call.room_waited_from

    def must_wait(self, now: float) -> MustWaitForRoom:
        """Register this thread as waiting; the caller raises what this returns, and the
        store's runner calls `wait` with it once the store's lock is let go."""
        call = self._call
        if call.room_deadline is None:
            call.room_deadline = now + self.wait_s
        with self._cond:
            self._waiting.add(threading.get_ident())
            self._changes += 1  # threads waiting on what this one holds see that it waits too
            self._cond.notify_all()
            return MustWaitForRoom(self._changes, call.room_deadline, now)

    def wait(self, wait: MustWaitForRoom, deadline: float | None) -> None:
        """Block (without the store's lock) until room may have appeared or the wait ends;
        `deadline` (monotonic) is the caller's own timeout, which ends the wait for room too."""
        end = wait.deadline if deadline is None else min(wait.deadline, deadline)
        if deadline is not None and deadline < wait.deadline:
            self._call.room_deadline = end
        with self._cond:
            try:
                while self._changes == wait.seen:
                    left = end - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            finally:
                self._waiting.discard(threading.get_ident())
                self._waits += 1
                # from the registration on (the deadline's origin), so a wait that runs out
                # counts its whole room_wait_s, the lock's hand-over included
                self._wait_total_s += time.monotonic() - wait.since

    def stats(self) -> tuple[int, float]:
        """Waits so far and their total seconds."""
        with self._cond:
            return self._waits, self._wait_total_s
