"""Building the learning-rate schedule (infinity.optim.lr_schedule) from the `scheduler` section:
the config describes it, the engine builds it."""

from __future__ import annotations

from infinity.config import SchedulerConfig, WarmupCosineLRParams, WarmupLRParams
from infinity.errors import ConfigError
from infinity.optim import LRSchedule, WarmupCosineLR, WarmupDecayLR, WarmupLR


def build_lr_schedule(scheduler: SchedulerConfig, *, optimizer_lr: float,
                      total_num_steps: int | None = None) -> LRSchedule:
    """The schedule `scheduler` describes, as a pure `lr_at(step)` record.

    optimizer_lr: the optimizer's learning rate (WarmupLR's default top, WarmupCosineLR's base).
    total_num_steps: used when the config left it "auto" (the Trainer's max_steps); ignored
        when the config gives a number.
    Raises ConfigError if a decaying schedule still has no total_num_steps, or if the values
    together are impossible (e.g. the optimizer's lr below warmup_min_lr).
    """
    params = scheduler.params
    total = getattr(params, "total_num_steps", None) or total_num_steps
    if scheduler.type != "WarmupLR" and total is None:
        raise ConfigError(f"scheduler.params.total_num_steps is needed by {scheduler.type} and "
                          "was \"auto\" or absent: write the number of training steps in the "
                          "config, or pass total_num_steps when the engine is created")
    common = {"warmup_num_steps": params.warmup_num_steps, "warmup_type": params.warmup_type}
    try:
        if isinstance(params, WarmupCosineLRParams):
            return WarmupCosineLR(base_lr=optimizer_lr, total_num_steps=total,
                                  warmup_min_ratio=params.warmup_min_ratio,
                                  cos_min_ratio=params.cos_min_ratio, **common)
        assert isinstance(params, WarmupLRParams)
        top = optimizer_lr if params.warmup_max_lr is None else params.warmup_max_lr
        if scheduler.type == "WarmupDecayLR":
            return WarmupDecayLR(warmup_min_lr=params.warmup_min_lr, warmup_max_lr=top,
                                 total_num_steps=total, **common)
        return WarmupLR(warmup_min_lr=params.warmup_min_lr, warmup_max_lr=top, **common)
    except ValueError as exc:
        raise ConfigError(f"scheduler ({scheduler.type}, optimizer lr {optimizer_lr}): "
                          f"{exc}") from None
