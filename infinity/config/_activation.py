"""`activation_checkpointing`: DeepSpeed's keys for activation recomputation
(`infinity.recompute.run`).

`initialize` hands this section to `infinity.recompute.configure` when a config sets any
of it; what each key does there is in docs/scale.md ("Activation memory").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from infinity.config._section import Section
from infinity.config._values import check

_NO_MODEL_PARALLELISM = ("Infinity has no model parallelism: checkpointed activations are not "
                         "partitioned")


@dataclass(kw_only=True, frozen=True)
class ActivationCheckpointingConfig(Section):
    """How `infinity.recompute.run` keeps and recomputes activations."""

    partition_activations: bool = False
    """DeepSpeed: partition checkpointed activations across model-parallel ranks. No effect
    here. Default false."""
    cpu_checkpointing: bool = False
    """Keep the inputs saved at recompute boundaries in (pinned) host memory while compute is
    on an accelerator; on the CPU they are there already. Default false."""
    contiguous_memory_optimization: bool = False
    """DeepSpeed: copy partitioned checkpoints into one buffer. No effect here. Default false."""
    number_checkpoints: int | None = None
    """DeepSpeed: checkpoints the contiguous buffer holds. No effect here. Default null."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronise the accelerator before and after each run of a recomputed function
    (forward and its recompute). Default false."""
    profile: bool = False
    """Time each run of a recomputed function (`infinity.recompute.timings()`).
    Default false."""

    NOT_HONOURED: ClassVar[dict[str, str]] = {
        "partition_activations": _NO_MODEL_PARALLELISM,
        "contiguous_memory_optimization": f"{_NO_MODEL_PARALLELISM}, so there are no partitions "
                                          "to lay out contiguously",
        "number_checkpoints": "sizes DeepSpeed's contiguous buffer, which Infinity does not have",
    }

    def __post_init__(self) -> None:
        check(self.number_checkpoints is None or self.number_checkpoints >= 1,
              "number_checkpoints", self.number_checkpoints, "null or an integer >= 1")
