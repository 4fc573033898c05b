"""The engine's own timeline (forward, backward, step, per-unit optimizer work, gradients
final), merged into the store's Perfetto trace by `Engine.write_trace`."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import NamedTuple


class Region(NamedTuple):
    name: str  # e.g. a unit's store key
    lane: str  # "compute", "optimizer", "grads final"
    start: float  # time.perf_counter() seconds
    end: float


class Timeline:
    """Regions in perf_counter seconds from `t0`; thread-safe; bounded to `max_events`."""

    def __init__(self, t0: float, max_events: int = 1_000_000) -> None:
        self.t0 = t0
        self._max = max_events
        self._lock = threading.Lock()
        self.regions: list[Region] = []

    def record(self, name: str, lane: str, start: float, end: float | None = None) -> None:
        with self._lock:
            if len(self.regions) < self._max:
                self.regions.append(Region(name, lane, start, start if end is None else end))

    @contextlib.contextmanager
    def region(self, name: str, lane: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(name, lane, start, time.perf_counter())

    def merge_into(self, path: str | os.PathLike[str]) -> None:
        """Add the regions to the Chrome trace at `path` (process 2, one row per lane). Both
        count from `t0`, the store's creation (`MoveLog.t0`)."""
        with open(path) as f:
            trace = json.load(f)
        with self._lock:
            regions = list(self.regions)
        lanes: dict[str, int] = {}
        events = trace["traceEvents"]
        for r in regions:
            tid = lanes.setdefault(r.lane, len(lanes) + 1)
            events.append({"name": r.name, "cat": r.lane, "ph": "X", "pid": 2, "tid": tid,
                           "ts": (r.start - self.t0) * 1e6, "dur": (r.end - r.start) * 1e6})
        for lane, tid in lanes.items():
            events.append({"name": "thread_name", "ph": "M", "pid": 2, "tid": tid,
                           "args": {"name": lane}})
        events.append({"name": "process_name", "ph": "M", "pid": 2, "args": {"name": "engine"}})
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w") as f:
            json.dump(trace, f)
        os.replace(tmp, path)
