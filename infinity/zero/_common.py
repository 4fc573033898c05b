"""Lifecycle of a fetch unit and the counters the coordinator keeps."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class UnitState(enum.Enum):
    """Where a unit's values are, as its parameters see them."""

    RELEASED = "released"  # params hold empty placeholders; no store use is held
    FETCHING = "fetching"  # a store fetch is in flight (prefetched); params still placeholders
    READY = "ready"  # params are views of the fetched flat tensor; one store use is held


@dataclass(slots=True)
class PrefetchStats:
    """How units arrived when a module needed them (cumulative since the engine started)."""

    acquires: int = 0  # module uses of a unit (forward and backward)
    prefetch_hits: int = 0  # the unit was already prefetched (in flight or landed) by the trace
    kept: int = 0  # the unit was still resident: kept for reuse, or used by another module
    on_demand: int = 0  # the unit had to be fetched when needed
    on_demand_nvme: int = 0  # ... its bytes only on NVMe (a full read on the critical path)
    after_optimizer: int = 0  # fetched when needed because the optimizer was still updating it
    stall_s: float = 0.0  # seconds spent waiting for bytes inside hooks
    trace_switches: int = 0  # passes that started on a memoised trace
    divergences: int = 0  # passes that left their trace (rest of the pass on demand)
    gathered_ahead: int = 0  # stage 3 on several ranks: all-gathers started one use early
