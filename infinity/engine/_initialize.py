"""`initialize`: the one entry function, as DeepSpeed's `deepspeed.initialize`."""

from __future__ import annotations

import os
from typing import Any

import torch

from infinity import recompute
from infinity.config import ActivationCheckpointingConfig, Config, load_config
from infinity.engine._engine import Engine
from infinity.engine._gathered import track
from infinity.engine._pretrained import attach_save_pretrained
from infinity.engine._threads import check_wait_policy
from infinity.zero import environment_world_size


def initialize(model: torch.nn.Module, config: dict[str, Any] | str | os.PathLike[str]) -> Engine:
    """Wrap `model` for training under `config` (a DeepSpeed-style dict or JSON file path).

    The model's parameters move into the engine's store (their tensors become empty
    placeholders between uses); train through the returned Engine, and `close()` it to remove
    the hooks and get ordinary parameters back.

    Under torchrun (or with torch.distributed initialised) every rank calls this with the
    same model and config: the ranks train one model data-parallel, partitioned by the ZeRO
    stage (docs/scale.md, "Ranks"); the batch sizes count every rank.

    Raises ConfigError (a ValueError) or ConfigPathError (an OSError) naming the key at fault,
    and BudgetError when host_memory_budget cannot hold the memory plan; all before anything
    is moved. A rank that dies or a collective that times out raises RankError on the others.
    A config that sets `activation_checkpointing` configures `infinity.recompute` with it
    (as `deepspeed.checkpointing.configure` would). A transformers model's `save_pretrained`
    then writes the values from the store (infinity/engine/_pretrained.py).

    A model from `infinity.models.load` carries its store in `model.infinity_placed` (a
    `Placed`): initialize adopts that store instead of placing the parameters again, and
    removes the attribute; `config` must lay the model out as the load's did (ConfigError
    names what differs, and the model keeps its store for a retry).
    """
    engine = Engine(model, engine_config(model, config))
    attach_to_model(engine)
    return engine


def engine_config(model: torch.nn.Module,
                  config: Config | dict[str, Any] | str | os.PathLike[str]) -> Config:
    """`config` loaded for `model` on this job's ranks; a config that sets
    `activation_checkpointing` configures `infinity.recompute` with it."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"initialize() needs a torch.nn.Module, got {type(model).__name__}")
    check_wait_policy()
    loaded = load_config(config, model=model, world_size=environment_world_size())
    if loaded.activation_checkpointing != ActivationCheckpointingConfig():
        recompute.configure(deepspeed_config=loaded.activation_checkpointing)
    return loaded


def attach_to_model(engine: Engine) -> None:
    """What the model's own methods need once its values live in the store: `save_pretrained`
    streams them (infinity/engine/_pretrained.py), and `GatheredParameters` finds the engine
    of a parameter (infinity/engine/_gathered.py)."""
    attach_save_pretrained(engine)
    track(engine)
