"""The training engine: `initialize(model, config) -> Engine` (see docs/engine.md)."""

from infinity.engine._client import LRSource, set_weight_decay
from infinity.engine._engine import Engine
from infinity.engine._gathered import gathered
from infinity.engine._initialize import attach_to_model, engine_config, initialize
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

__all__ = ["Engine", "LRSource", "Layout", "ParamSpec", "Placed", "StepCounters", "StepPhase",
           "attach_to_model", "build_lr_schedule", "choose_model_precision", "cpu_has_bf16_units",
           "engine_config", "gathered", "initialize", "lay_out", "open_store", "parameter_specs",
           "set_weight_decay"]
