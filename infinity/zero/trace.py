"""Layer traces: the order in which a pass uses fetch units, recorded once and memoised.

A pass (one forward, plus its backward when training) is keyed by how it runs (train/eval, grad
on/off). Under one key several traces are kept, most recently used first; a pass follows every
trace whose prefix matches what it has done so far, so train/eval alternation or a changed route
switches traces instead of turning prefetch off; a key seen for the first time follows the
other keys' traces while their prefix matches. When no trace matches any more the pass has
diverged: the rest of it fetches on demand, and what it did is memoised as a new trace.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


class Trace:
    """One recorded pass: unit indices in order of use, with O(1) look-ups for the scheduler."""

    __slots__ = ("units", "next_pos", "first_pos", "_cum_numel")

    def __init__(self, units: Sequence[int], numels: Sequence[int]) -> None:
        self.units = tuple(units)
        following: dict[int, int] = {}
        next_pos = [len(self.units)] * len(self.units)
        for i in range(len(self.units) - 1, -1, -1):  # next occurrence of the same unit
            next_pos[i] = following.get(self.units[i], len(self.units))
            following[self.units[i]] = i
        self.next_pos = tuple(next_pos)
        self.first_pos = following  # unit -> its first position
        cum = [0]
        for u in self.units:
            cum.append(cum[-1] + numels[u])
        self._cum_numel = tuple(cum)

    def __len__(self) -> int:
        return len(self.units)

    def numel_between(self, start: int, stop: int) -> int:
        """Elements used at positions [start, stop) (a unit used twice counts twice)."""
        return self._cum_numel[stop] - self._cum_numel[start]


class PassCursor:
    """Follows one pass along the memoised traces of its key and records what really happens."""

    def __init__(self, key: Hashable, candidates: list[Trace]) -> None:
        self.key = key
        self.recorded: list[int] = []
        self.candidates = candidates  # traces whose prefix matches the pass so far, best first
        self.started_on_trace = bool(candidates)
        self.diverged = False

    @property
    def pos(self) -> int:
        """Position of the latest use (-1 before the first)."""
        return len(self.recorded) - 1

    @property
    def trace(self) -> Trace | None:
        """The trace the pass follows now (None when it has none or left it)."""
        return self.candidates[0] if self.candidates else None

    def observe(self, unit: int) -> bool:
        """Record one use; returns True when this use made the pass leave its traces."""
        pos = len(self.recorded)
        self.recorded.append(unit)
        if not self.candidates:
            return False
        self.candidates = [t for t in self.candidates if pos < len(t) and t.units[pos] == unit]
        if not self.candidates:
            self.diverged = True
            return True
        return False


class TraceBook:
    """Memoised traces per pass key, at most `max_traces` per key (least recently used dropped)."""

    def __init__(self, numels: Sequence[int], max_traces: int = 4) -> None:
        if max_traces < 1:
            raise ValueError(f"max_traces must be >= 1, got {max_traces}")
        self._numels = list(numels)
        self._max = max_traces
        self._traces: dict[Hashable, list[Trace]] = {}

    def start(self, key: Hashable) -> PassCursor:
        """Begin following a pass. A key with no trace yet borrows every other key's traces:
        routes often share a prefix (an eval pass runs the forward of a training pass)."""
        own = self._traces.get(key)
        if own:
            return PassCursor(key, list(own))
        return PassCursor(key, [t for traces in self._traces.values() for t in traces])

    def finish(self, cursor: PassCursor) -> Trace | None:
        """Memoise the pass: move the trace it followed to the front, or add what it did;
        returns that trace (None for a pass that used no unit)."""
        traces = self._traces.setdefault(cursor.key, [])
        done = len(cursor.recorded)
        match = next((t for t in cursor.candidates if len(t) == done), None)
        if match is None:
            if not done:
                return None
            match = Trace(cursor.recorded, self._numels)
        else:
            traces.remove(match)
        traces.insert(0, match)
        del traces[self._max:]
        return match

    def count(self, key: Hashable) -> int:
        return len(self._traces.get(key, ()))
