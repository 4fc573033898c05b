"""The training engine: `initialize(model, config) -> Engine` (see docs/engine.md)."""

from infinity.engine._engine import Engine
from infinity.engine._initialize import initialize

__all__ = ["Engine", "initialize"]
