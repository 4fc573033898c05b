"""The training engine: `initialize(model, config) -> Engine` (see docs/engine.md)."""

from infinity.engine._engine import Engine
from infinity.engine._initialize import initialize
from infinity.engine._params import ParamSpec, iter_parameters, parameter_specs

__all__ = ["Engine", "ParamSpec", "initialize", "iter_parameters", "parameter_specs"]
