"""Infinity: fine-tune models larger than accelerator memory and RAM with tiered offload."""

from infinity import checkpointing, models
from infinity.engine import Engine, initialize
from infinity.errors import BudgetError, CheckpointError, ConfigError, ConfigPathError, RankError

__all__ = ["BudgetError", "CheckpointError", "ConfigError", "ConfigPathError", "Engine", "RankError",
           "checkpointing", "initialize", "models"]
