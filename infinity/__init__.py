"""Infinity: fine-tune models larger than accelerator memory and RAM with tiered offload."""

from infinity import models, recompute
from infinity.engine import Engine, initialize
from infinity.errors import (
    BudgetError,
    CheckpointError,
    ClosedError,
    ConfigError,
    ConfigPathError,
    NonFiniteGradientError,
    RankError,
)

__all__ = ["BudgetError", "CheckpointError", "ClosedError", "ConfigError", "ConfigPathError",
           "Engine", "NonFiniteGradientError", "RankError", "initialize", "models", "recompute"]
