"""The training engine: `initialize(model, config) -> Engine` (see docs/engine.md)."""

from infinity.engine._engine import Engine
from infinity.engine._initialize import initialize
from infinity.engine._params import ParamSpec, parameter_specs
from infinity.engine._placement import (
    Layout,
    Placed,
    attach_placed,
    choose_model_precision,
    lay_out,
    open_store,
)
from infinity.engine._precision import cpu_has_bf16_units

__all__ = ["Engine", "Layout", "ParamSpec", "Placed", "attach_placed", "choose_model_precision",
           "cpu_has_bf16_units", "initialize", "lay_out", "open_store", "parameter_specs"]
