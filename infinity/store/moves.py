"""What the store moved: per-direction counters and a timeline for Chrome / Perfetto."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass

from infinity.store._common import Tier


@dataclass(slots=True)
class DirectionStats:
    """Bytes and busy time of one direction of moves (e.g. nvme -> host)."""

    nbytes: int = 0
    seconds: float = 0.0  # sum of per-move wall times (overlapping moves add up)
    moves: int = 0

    @property
    def gbps(self) -> float:
        """Per-move throughput in GB/s (1e9 bytes)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds else 0.0


class MoveLog:
    """Counters per (source, destination) and, optionally, every move with its times.

    Thread-safe: its own lock is a leaf (taken alone or after the store's lock)."""

    def __init__(self, *, keep_timeline: bool = True, max_events: int = 1_000_000) -> None:
        self._lock = threading.Lock()
        self.t0 = time.perf_counter()  # the trace's zero: a timeline merged into it shares it
        self._keep_timeline = keep_timeline
        self._max_events = max_events
        self._events: list[tuple[str, Tier, Tier, int, float, float]] = []
        self.directions: dict[tuple[Tier, Tier], DirectionStats] = {}

    def now(self) -> float:
        return time.perf_counter()

    def record(self, key: str, src: Tier, dst: Tier, nbytes: int, start: float, end: float) -> None:
        with self._lock:
            stats = self.directions.setdefault((src, dst), DirectionStats())
            stats.nbytes += nbytes
            stats.seconds += end - start
            stats.moves += 1
            if self._keep_timeline and len(self._events) < self._max_events:
                self._events.append((key, src, dst, nbytes, start, end))

    def summary(self) -> dict[str, dict[str, float]]:
        """{"host->nvme": {"nbytes", "seconds", "moves", "gbps"}, ...}"""
        with self._lock:
            return {
                f"{src.label}->{dst.label}": {
                    "nbytes": s.nbytes, "seconds": s.seconds, "moves": s.moves, "gbps": s.gbps,
                }
                for (src, dst), s in sorted(self.directions.items())
            }

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """Save the timeline as Chrome trace JSON (open in ui.perfetto.dev or chrome://tracing).

        One row per direction; each move is a slice named after its key.
        """
        with self._lock:
            events = list(self._events)
        rows = {}
        trace = []
        for key, src, dst, nbytes, start, end in events:
            lane = f"{src.label}->{dst.label}"
            tid = rows.setdefault(lane, len(rows) + 1)
            trace.append({
                "name": key, "cat": lane, "ph": "X", "pid": 1, "tid": tid,
                "ts": (start - self.t0) * 1e6, "dur": max(0.0, end - start) * 1e6,
                "args": {"nbytes": nbytes},
            })
        for lane, tid in rows.items():
            trace.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid,
                          "args": {"name": lane}})
        tmp = f"{os.fspath(path)}.tmp"
        with open(tmp, "w") as f:
            json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, path)
