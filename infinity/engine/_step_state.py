"""What the engine keeps of its step cycle: the phase of the optimizer step, with the moves
between phases (docs/engine.md, "The step's phases"; a move not in the table is a bug and
raises, as `FetchUnit.expect` does for a unit's states), and the step counters a checkpoint
saves."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any


class StepPhase(enum.Enum):
    """Where the engine is in its step cycle."""

    IDLE = "idle"  # no step under way: forward, backward and the gradients' accumulation go on
    STEPPING = "stepping in backward"  # the boundary backward hands units to the optimizer worker
    VALIDATING = "validating"  # backward is over: the global norm and finiteness decide the step
    TAIL_OPEN = "tail open"  # step() returned with units still being stepped (one process)
    BROKEN = "broken"  # a rollback failed, part of a step stays applied: a checkpoint load
    # goes on
    CLOSED = "closed"


_MOVES: dict[StepPhase, frozenset[StepPhase]] = {
    StepPhase.IDLE: frozenset({StepPhase.STEPPING, StepPhase.VALIDATING, StepPhase.CLOSED}),
    StepPhase.STEPPING: frozenset({StepPhase.VALIDATING, StepPhase.CLOSED}),
    StepPhase.VALIDATING: frozenset({StepPhase.IDLE, StepPhase.TAIL_OPEN, StepPhase.BROKEN,
                                     StepPhase.CLOSED}),
    StepPhase.TAIL_OPEN: frozenset({StepPhase.IDLE, StepPhase.CLOSED}),
    StepPhase.BROKEN: frozenset({StepPhase.IDLE, StepPhase.CLOSED}),
    StepPhase.CLOSED: frozenset(),
}


def check_move(now: StepPhase, to: StepPhase) -> StepPhase:
    """`to`, if the step may move there from `now`; else RuntimeError naming both."""
    if to not in _MOVES[now]:
        raise RuntimeError(f"the optimizer step cannot go from {now.value!r} to {to.value!r}")
    return to


@dataclasses.dataclass
class StepCounters:
    """The engine's step counts (what a checkpoint saves under these names)."""

    global_steps: int = 0  # optimizer steps taken (skipped fp16 steps included, as DeepSpeed)
    micro_steps: int = 0  # calls of step(), one per micro-batch
    skipped_steps: int = 0  # fp16 steps skipped for a gradient overflow
    schedule_steps: int = 0  # steps the LR schedule moved on for (applied ones, as DeepSpeed)

    @classmethod
    def from_saved(cls, saved: Mapping[str, Any]) -> StepCounters:
        """The counters a checkpoint's metadata holds (absent ones: 0)."""
        return cls(**{f.name: int(saved.get(f.name, 0)) for f in dataclasses.fields(cls)})
