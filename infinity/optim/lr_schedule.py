"""DeepSpeed's warmup learning-rate schedules as pure functions of the step.

Each schedule is a frozen record of plain numbers with one method, `lr_at(step)`, so the engine
can ask for any step (resume, logging) without stepping an object. The formulas follow
DeepSpeed's `WarmupLR`, `WarmupDecayLR` and `WarmupCosineLR` (deepspeed/runtime/lr_schedules.py):

- `step` is DeepSpeed's `last_batch_iteration`: the number of scheduler steps taken so far, minus
  one. DeepSpeed builds the scheduler at -1 and steps it after each applied optimizer update, so
  update number k (0-based, skipped fp16 steps not counted) runs with `lr_at(k - 1)`.
- The warmup length is at least 2 steps (DeepSpeed's `max(2, warmup_num_steps)`), so the log
  warmup never divides by log(1).
- "log" warmup: gamma = log(step + 1) / log(W); "linear": gamma = step / W; gamma = 1 after W.

This module takes numbers only; the engine builds a schedule from the config's `scheduler` section.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LRSchedule", "WARMUP_TYPES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

WARMUP_TYPES = ("log", "linear")


def _check(name: str, ok: bool, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: {allowed}")


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Warmup:
    """The warmup ramp shared by all three schedules."""

    warmup_num_steps: int = 1000
    """Steps of warmup (DeepSpeed uses at least 2). Default 1000."""
    warmup_type: str = "log"
    """'log' or 'linear' ramp. Default 'log'."""

    def __post_init__(self) -> None:
        _check("warmup_num_steps", isinstance(self.warmup_num_steps, int)
               and not isinstance(self.warmup_num_steps, bool) and self.warmup_num_steps >= 0,
               self.warmup_num_steps, "an integer >= 0")
        _check("warmup_type", self.warmup_type in WARMUP_TYPES, self.warmup_type,
               f"one of {WARMUP_TYPES}")

    @property
    def effective_warmup_steps(self) -> int:
        """The warmup length DeepSpeed really uses: max(2, warmup_num_steps)."""
        return max(2, self.warmup_num_steps)

    def _warmup_gamma(self, step: int) -> float:
        """Fraction of the ramp done at `step` (0 <= step < effective_warmup_steps)."""
        if self.warmup_type == "log":
            return math.log(step + 1) / math.log(self.effective_warmup_steps)
        return step / self.effective_warmup_steps


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmupLR(_Warmup):
    """Ramp from `warmup_min_lr` to `warmup_max_lr` over the warmup, then hold `warmup_max_lr`."""

    warmup_min_lr: float = 0.0
    """Learning rate at the start of warmup. Default 0."""
    warmup_max_lr: float = 1e-3
    """Learning rate at the end of warmup (DeepSpeed: the optimizer's lr when not given)."""

    def __post_init__(self) -> None:
        _Warmup.__post_init__(self)
        for name in ("warmup_min_lr", "warmup_max_lr"):
            value = getattr(self, name)
            _check(name, _is_real(value) and value >= 0, value, "a finite number >= 0")
        _check("warmup_max_lr", self.warmup_max_lr >= self.warmup_min_lr, self.warmup_max_lr,
               f"at least warmup_min_lr={self.warmup_min_lr!r}")

    def _gamma(self, step: int) -> float:
        if step < self.effective_warmup_steps:
            return self._warmup_gamma(step)
        return 1.0

    def lr_at(self, step: int) -> float:
        """Learning rate after `step` + 1 scheduler steps; step -1 (not started) is the minimum."""
        if step < 0:
            return float(self.warmup_min_lr)
        return self.warmup_min_lr + (self.warmup_max_lr - self.warmup_min_lr) * self._gamma(step)


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at `total_num_steps`."""

    total_num_steps: int = 0
    """Step at which the learning rate reaches 0 (required in DeepSpeed)."""

    def __post_init__(self) -> None:
        WarmupLR.__post_init__(self)
        _check("total_num_steps", isinstance(self.total_num_steps, int)
               and not isinstance(self.total_num_steps, bool) and self.total_num_steps > 0,
               self.total_num_steps, "an integer > 0")

    def _gamma(self, step: int) -> float:
        if step < self.effective_warmup_steps:
            return self._warmup_gamma(step)
        remaining = self.total_num_steps - step
        return max(0.0, remaining / max(1.0, self.total_num_steps - self.effective_warmup_steps))


@dataclass(frozen=True, slots=True, kw_only=True)
class WarmupCosineLR(_Warmup):
    """A ratio of the optimizer's `base_lr`: warmup from `warmup_min_ratio` to 1, then a cosine
    decay to `cos_min_ratio` at `total_num_steps` (held there afterwards)."""

    base_lr: float = 1e-3
    """The optimizer's learning rate, which the ratios multiply."""
    total_num_steps: int = 0
    """Step at which the cosine reaches `cos_min_ratio` (required in DeepSpeed)."""
    warmup_min_ratio: float = 0.0
    """Ratio of `base_lr` at the start of warmup. Default 0."""
    cos_min_ratio: float = 1e-4
    """Ratio of `base_lr` at the end of the cosine. Default 0.0001."""

    def __post_init__(self) -> None:
        _Warmup.__post_init__(self)
        _check("base_lr", _is_real(self.base_lr) and self.base_lr >= 0, self.base_lr,
               "a finite number >= 0")
        _check("total_num_steps", isinstance(self.total_num_steps, int)
               and not isinstance(self.total_num_steps, bool) and self.total_num_steps > 0,
               self.total_num_steps, "an integer > 0")
        for name in ("warmup_min_ratio", "cos_min_ratio"):
            value = getattr(self, name)
            _check(name, _is_real(value) and 0 <= value <= 1, value, "a number in [0, 1]")

    def ratio_at(self, step: int) -> float:
        """The multiplier of `base_lr` at `step`; 0 before the first scheduler step (-1)."""
        if step < 0:
            return 0.0
        warmup = self.effective_warmup_steps
        if step < warmup:
            return self.warmup_min_ratio + self._warmup_gamma(step) * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (step - warmup + 1) / max(1, self.total_num_steps - warmup))
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, step: int) -> float:
        return self.base_lr * self.ratio_at(step)


LRSchedule = WarmupLR | WarmupDecayLR | WarmupCosineLR
