"""Infinity: fine-tune models larger than accelerator memory and RAM with tiered offload."""

from infinity import models, recompute
from infinity.engine import Engine, initialize
from infinity.errors import BudgetError, CheckpointError, ConfigError, ConfigPathError, RankError

__all__ = ["BudgetError", "CheckpointError", "ConfigError", "ConfigPathError", "Engine", "RankError",
           "initialize", "models", "recompute"]
