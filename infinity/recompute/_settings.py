"""The process-wide settings of `run`, as DeepSpeed's `deepspeed.checkpointing.configure` keeps
them (its callers, Megatron-style models, call `checkpoint` from deep inside forward where
no engine object is at hand).

Every key DeepSpeed reads is taken; those with no effect here say so in one log line when set.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from infinity.config import ActivationCheckpointingConfig, Config, load_config

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Timings:
    """Wall time of recomputed functions while `profile` is on (cumulative since configure)."""

    calls: int = 0  # forward runs of a recomputed function
    forward_s: float = 0.0
    recomputes: int = 0  # runs of a recomputed function inside backward
    recompute_s: float = 0.0


_settings: ActivationCheckpointingConfig | None = None
_timings = Timings()


def configure(mpu_: Any = None, deepspeed_config: Any = None,
              partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> ActivationCheckpointingConfig:
    """Set how `run` behaves (DeepSpeed's signature and argument names).

    `deepspeed_config` is a DeepSpeed config (dict, JSON path or `Config`) or its
    `activation_checkpointing` section; the keyword arguments override it. `mpu_` is accepted
    for DeepSpeed's signature: Infinity has no model parallelism. Returns the settings now in
    force; `infinity.initialize` calls this with its config's section when the config sets it.
    """
    global _settings, _timings
    settings = _section(deepspeed_config)
    overrides = {"partition_activations": partition_activations,
                 "contiguous_memory_optimization": contiguous_checkpointing,
                 "number_checkpoints": num_checkpoints, "cpu_checkpointing": checkpoint_in_cpu,
                 "synchronize_checkpoint_boundary": synchronize, "profile": profile}
    settings = replace(settings, **{k: v for k, v in overrides.items() if v is not None})
    _settings, _timings = settings, Timings()
    _log_without_effect(settings, mpu_)
    return settings


def is_configured() -> bool:
    """True once `configure` ran (and `reset` did not follow)."""
    return _settings is not None


def reset() -> None:
    """Back to the defaults (nothing configured) and zero timings."""
    global _settings, _timings
    _settings, _timings = None, Timings()


def settings() -> ActivationCheckpointingConfig:
    """The settings in force (DeepSpeed's defaults when nothing was configured)."""
    return _settings if _settings is not None else ActivationCheckpointingConfig()


def timings() -> dict[str, float]:
    """What `profile` measured since `configure`: calls, forward_s, recomputes, recompute_s."""
    return {name: getattr(_timings, name) for name in Timings.__slots__}


def record(*, recompute: bool, seconds: float) -> None:
    """Add one timed run of a recomputed function."""
    if recompute:
        _timings.recomputes += 1
        _timings.recompute_s += seconds
    else:
        _timings.calls += 1
        _timings.forward_s += seconds


def _section(deepspeed_config: Any) -> ActivationCheckpointingConfig:
    if deepspeed_config is None:
        return ActivationCheckpointingConfig()
    if isinstance(deepspeed_config, ActivationCheckpointingConfig):
        return deepspeed_config
    if isinstance(deepspeed_config, (Config, dict, str, os.PathLike)):
        return load_config(deepspeed_config).activation_checkpointing
    raise TypeError(f"configure(deepspeed_config=...) takes a DeepSpeed config (dict, JSON path, "
                    f"Config) or an ActivationCheckpointingConfig, got "
                    f"{type(deepspeed_config).__name__}")


def _log_without_effect(settings: ActivationCheckpointingConfig, mpu_: Any) -> None:
    """One line naming every setting that changes nothing here, and why."""
    notes = []
    if mpu_ is not None:
        notes.append("mpu_ (no model parallelism)")
    if settings.partition_activations:
        notes.append("partition_activations (no model-parallel ranks to partition across)")
    if settings.contiguous_memory_optimization:
        notes.append("contiguous_memory_optimization (no partitions to lay out contiguously)")
    if settings.number_checkpoints is not None:
        notes.append("number_checkpoints (sizes a contiguous buffer Infinity does not have)")
    if not torch.cuda.is_available():
        if settings.cpu_checkpointing:
            notes.append("cpu_checkpointing (compute is on the CPU: checkpointed activations are "
                         "in host memory already)")
        if settings.synchronize_checkpoint_boundary:
            notes.append("synchronize_checkpoint_boundary (no accelerator to synchronise)")
    if notes:
        logger.info("activation_checkpointing: accepted without effect: %s", "; ".join(notes))
