"""The training engine: `initialize(model, config) -> Engine` (see docs/engine.md)."""

from infinity.engine._engine import Engine
from infinity.engine._initialize import initialize
from infinity.engine._params import ParamSpec, parameter_specs
from infinity.engine._placement import (
    Layout,
    Placed,
    choose_model_precision,
    lay_out,
    open_store,
)
from infinity.engine._precision import cpu_has_bf16_units
from infinity.engine._schedule import build_lr_schedule
from infinity.engine._step_state import StepCounters, StepPhase

__all__ = ["Engine", "Layout", "ParamSpec", "Placed", "StepCounters", "StepPhase", "build_lr_schedule",
           "choose_model_precision", "cpu_has_bf16_units", "initialize", "lay_out", "open_store",
           "parameter_specs"]
