"""DeepSpeed's activation checkpointing (`deepspeed.checkpointing`), which Infinity calls
recomputation: `checkpoint` is `infinity.recompute.run` (non-reentrant unless
`use_reentrant=True`, DeepSpeed's kind; the non-reentrant kind also gives parameter gradients
when no argument requires grad), `configure` takes DeepSpeed's keys. See docs/scale.md,
"Activation memory"."""

from infinity.recompute import configure, is_configured, reset
from infinity.recompute import run as checkpoint

__all__ = ["checkpoint", "configure", "is_configured", "reset"]
