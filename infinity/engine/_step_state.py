"""What the engine keeps of its step cycle: the step counters a checkpoint saves."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any


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
