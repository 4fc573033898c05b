"""Dynamic loss scaling for fp16: grow the scale while steps are clean, back off on overflow."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class DynamicLossScaler:
    """DeepSpeed's fp16 semantics under its config names.

    Attributes:
        scale: the current loss scale (fp16 `2 ** initial_scale_power`, default 2**16).
        window: clean steps before the scale doubles (`loss_scale_window`, 1000).
        hysteresis: overflows tolerated before the scale halves (`hysteresis`, 2).
        min_scale: the scale never drops below this (`min_loss_scale`, 1).
    """

    scale: float = 2.0**16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    _clean_steps: int = 0
    _overflows_left: int = -1

    def __post_init__(self) -> None:
        if self.scale <= 0 or self.min_scale <= 0 or self.window < 1 or self.hysteresis < 1:
            raise ValueError(
                f"loss scaler needs scale > 0, min_scale > 0, window >= 1, hysteresis >= 1; got "
                f"{self.scale=}, {self.min_scale=}, {self.window=}, {self.hysteresis=}"
            )
        self._overflows_left = self.hysteresis

    def update(self, overflow: bool) -> None:
        """Account for one step; call after every step, skipped or not."""
        if overflow:
            self._clean_steps = 0
            self._overflows_left -= 1
            if self._overflows_left <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
                self._overflows_left = self.hysteresis
                logger.info("gradient overflow: loss scale lowered to %g", self.scale)
            return
        self._clean_steps += 1
        if self._clean_steps % self.window == 0:
            self.scale *= 2
            self._overflows_left = self.hysteresis

    def state_dict(self) -> dict[str, float]:
        return {"scale": self.scale, "clean_steps": self._clean_steps,
                "overflows_left": self._overflows_left}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.scale = float(state["scale"])
        self._clean_steps = int(state["clean_steps"])
        self._overflows_left = int(state["overflows_left"])
