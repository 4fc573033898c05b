"""The optimizer worker of [Note: optimizer overlapped with backward]: units are queued as their
gradients become final and stepped one at a time, in queue order, on one thread; each queued
unit has a future. The queue can be re-sorted while it runs ([Note: the step's tail in the next
forward], infinity/engine/_engine.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor


class UnitStepper:
    """Steps queued units on a worker thread.

    Args:
        step: steps unit i (runs on the worker).
        read_ahead: starts reading unit i's optimizer state without waiting (a hint), called
            for the unit queued right behind the running one.
    """

    def __init__(self, step: Callable[[int], None], read_ahead: Callable[[int], None]) -> None:
        self._step, self._read_ahead = step, read_ahead
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="infinity-optim")
        self._lock = threading.Lock()
        self._waiting: list[tuple[int, Future[None]]] = []  # queued, not started, in running order
        self._running: int | None = None
        self._futures: dict[int, Future[None]] = {}

    def submit(self, i: int) -> None:
        """Queue unit i (once per step)."""
        with self._lock:
            if i in self._futures:
                raise RuntimeError(f"unit {i} queued twice in one step")
            self._futures[i] = future = Future()
            self._waiting.append((i, future))
            behind_running = self._running is not None and len(self._waiting) == 1
        if behind_running:
            self._read_ahead(i)
        self._executor.submit(self._run_next)

    def pending(self) -> int:
        """Units queued or running: how many a unit submitted now waits for."""
        with self._lock:
            return len(self._waiting) + (self._running is not None)

    def reorder(self, key: Callable[[int], Hashable]) -> list[int]:
        """Units not started yet run in `key` order from now on (the new first one has its
        state read now if a unit is running). Returns the units not stepped yet, in the order
        they will be done: the running one, then the queue."""
        with self._lock:
            self._waiting.sort(key=lambda queued: key(queued[0]))
            left = ([] if self._running is None else [self._running]) + [i for i, _ in self._waiting]
            first = self._waiting[0][0] if self._waiting and self._running is not None else None
        if first is not None:
            self._read_ahead(first)
        return left

    def future(self, i: int) -> Future[None] | None:
        """Unit i's future in this step (None: not queued)."""
        return self._futures.get(i)

    def mark_done(self, i: int) -> None:
        """Unit i was stepped elsewhere (a retry after its future failed)."""
        done: Future[None] = Future()
        done.set_result(None)
        self._futures[i] = done

    def take(self) -> dict[int, Future[None]]:
        """The step's futures; the next submit starts a new step."""
        futures, self._futures = self._futures, {}
        return futures

    def shutdown(self) -> None:
        """Finish what is queued and stop the thread."""
        self._executor.shutdown(wait=True)

    def _run_next(self) -> None:
        with self._lock:
            i, future = self._waiting.pop(0)
            self._running = i
            following = self._waiting[0][0] if self._waiting else None
        try:
            if following is not None:  # read its state while this one computes
                self._read_ahead(following)
            self._step(i)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the unit
            future.set_exception(exc)
        else:
            future.set_result(None)
        finally:
            with self._lock:
                self._running = None
