"""DeepSpeed's training API over Infinity: `import infinity.deepspeed as deepspeed`, and a
DeepSpeed script runs unchanged (docs/hf.md). `initialize` returns (engine, optimizer,
training_dataloader, lr_scheduler) with DeepSpeed's meanings; `zero.Init`,
`zero.GatheredParameters`, `checkpointing` (activation checkpointing), `add_config_arguments`
and `init_distributed` are there too."""

from infinity.deepspeed import checkpointing, zero
from infinity.deepspeed._engine import DeepSpeedEngine
from infinity.deepspeed._initialize import add_config_arguments, init_distributed, initialize
from infinity.deepspeed._optimizer import EngineOptimizer

__all__ = [
    "DeepSpeedEngine",
    "EngineOptimizer",
    "add_config_arguments",
    "checkpointing",
    "init_distributed",
    "initialize",
    "zero",
]
