"""Activation recomputation: `run(function, *args)` keeps only the inputs of `function` and runs
it again in backward; `configure` takes DeepSpeed's `activation_checkpointing` keys. DeepSpeed
calls this activation checkpointing (`deepspeed.checkpointing.checkpoint`); in Infinity a
checkpoint is saved training state. See docs/scale.md, "Activation memory"."""

from infinity.recompute._run import run
from infinity.recompute._settings import configure, is_configured, reset, settings, timings

__all__ = ["configure", "is_configured", "reset", "run", "settings", "timings"]
