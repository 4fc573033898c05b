"""The training engine: `initialize(model, config) -> Engine` (see docs/engine.md)."""

from infinity.engine._client import LRSource, set_weight_decay
from infinity.engine._engine import Engine
from infinity.engine._gathered import gathered
from infinity.engine._initialize import attach_to_model, engine_config, initialize
from infinity.engine._params import ParamSpec, parameter_specs
from infinity.engine._placement import (
    Layout,
    Placed,
    attach_placed,
    choose_model_precision,
    is_placed,
    lay_out,
    open_store,
)

__all__ = ["Engine", "LRSource", "Layout", "ParamSpec", "Placed", "attach_placed",
           "attach_to_model", "choose_model_precision", "engine_config", "gathered", "initialize",
           "is_placed", "lay_out", "open_store", "parameter_specs", "set_weight_decay"]
