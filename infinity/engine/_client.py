"""What a client's optimizer and scheduler (DeepSpeed's `initialize(optimizer=, lr_scheduler=)`)
change in the engine: the weight decay of each parameter group, laid out over the units'
elements, and the learning rate each applied step takes from the client's scheduler.

The engine's optimizer stays the CPU Adam over units. A parameter group's weight decay becomes a
span of elements of the unit holding the parameter (`SwappedOptimizer.set_weight_decay`), so
decay and no-decay parameters may share a unit; the learning rate is read from an `LRSource`
when an update is built, and the source is advanced after each applied step (an fp16 step
skipped for overflow does not advance it), as DeepSpeed steps a client's scheduler.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from infinity.optim import DecaySpan

if TYPE_CHECKING:
    from infinity.engine._engine import Engine


class LRSource(Protocol):
    """A learning rate that moves with the applied steps (a client's LR scheduler)."""

    def lr(self) -> float:
        """The learning rate of the next update."""

    def advance(self) -> None:
        """One update was applied."""


def set_weight_decay(engine: Engine, decay_of: Mapping[str, float]) -> None:
    """Give each parameter named in `decay_of` its weight decay in the engine's optimizer (the
    others keep the optimizer's), on this rank's part of each unit."""
    for i, unit in enumerate(engine.ranked.trained):
        j = engine.ranked.optimizer_index.get(i)
        if j is None:  # this rank steps no element of the unit
            continue
        first, real, _ = engine.ranked.own_state_span(i)
        spans = []
        for slot in unit.slots:
            if slot.name not in decay_of:
                continue
            lo = max(slot.offset, first)
            hi = min(slot.offset + slot.shape.numel(), first + real)
            if lo < hi:
                spans.append(DecaySpan(lo - first, hi - first, decay_of[slot.name]))
        if spans:
            engine.optimizer.set_weight_decay(j, spans)
