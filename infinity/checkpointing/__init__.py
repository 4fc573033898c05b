"""Activation checkpointing with DeepSpeed's API (`deepspeed.checkpointing`): `checkpoint`,
`configure` and the `activation_checkpointing` keys. See docs/scale.md, "Activation memory"."""

from infinity.checkpointing._checkpoint import checkpoint, run_checkpointed
from infinity.checkpointing._host import HostCopy, HostOffload
from infinity.checkpointing._settings import configure, is_configured, reset, settings, timings

__all__ = ["HostCopy", "HostOffload", "checkpoint", "configure", "is_configured", "reset",
           "run_checkpointed", "settings", "timings"]
