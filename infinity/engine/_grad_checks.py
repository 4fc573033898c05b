"""What the step checks of this step's gradients before it is taken: each unit's sum of squares,
the global norm over every rank's shard, finiteness, and the clip factor (DeepSpeed's). The
engine decides the step from them (`OptimizerStep.validate`: refuse, skip on an fp16 overflow, or
step with this clip factor)."""

from __future__ import annotations

import math

from infinity.engine._partition import RankedUnits
from infinity.errors import NonFiniteGradientError
from infinity.zero import FetchUnit


def grad_square(unit: FetchUnit) -> float:
    """The sum of squares of the unit's gradient of this step, the term of the global norm it
    contributes (`GradBuffer.square()`: its pieces' sums of squares in float64; 0.0 when it
    has none)."""
    return 0.0 if unit.grad is None else unit.grad.square()


def global_norm(ranked: RankedUnits, squares: list[float]) -> float:
    """L2 norm from each unit's gradient sum of squares (in unit order, float64; over every
    rank's shard when the gradients are partitioned)."""
    return math.sqrt(ranked.sum_over_shards(sum(squares), "gradient norm"))


def refuse_non_finite(ranked: RankedUnits) -> None:
    """Raise, with nothing changed, when a gradient of this step holds inf/nan (on any rank:
    every rank takes or refuses the step)."""
    bad = [u.key for u in ranked.trained if u.grad is not None and not u.grad.is_finite()]
    if ranked.sum_over_shards(float(len(bad)), "non-finite gradient count") > 0:
        raise NonFiniteGradientError(
            f"non-finite gradient values (inf/nan) in {', '.join(bad) or 'another rank'}: "
            "the step was not taken, no parameter changed")


def clip_factor(norm: float | None, clipping: float) -> float:
    """What the gradients are multiplied by so that their norm is at most `clipping` (0: no
    clipping; 1.0 without a norm)."""
    if norm is not None and clipping > 0 and norm > 0:
        return min(1.0, clipping / (norm + 1e-6))
    return 1.0
