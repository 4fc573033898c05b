"""How tensors other than model weights are named inside a checkpoint.

A model weight keeps its module name ("model.layers.0.mlp.up_proj.weight"). An optimizer state
of a parameter is "<state>/<parameter name>" ("exp_avg/model.layers.0.mlp.up_proj.weight"); a
module name never holds "/", so the two never collide and a converter to model formats keeps the
names without one.
"""

from __future__ import annotations

ADAM_STATES = ("exp_avg", "exp_avg_sq")


def optimizer_state_name(state: str, parameter: str) -> str:
    """"exp_avg", "w" -> "exp_avg/w"."""
    return f"{state}/{parameter}"


def is_model_weight(name: str) -> bool:
    """Whether `name` is a model weight (or buffer), not optimizer or engine state."""
    return "/" not in name
