"""A DeepSpeed config's "auto" values filled from the Trainer's `TrainingArguments`, as
transformers' `HfTrainerDeepSpeedConfig` fills them (its `trainer_config_process` and
`trainer_config_finalize`), so a config written for `TrainingArguments(deepspeed=...)` means the
same here.

- A key is filled only where its section exists in the config (an absent `optimizer` section
  stays absent); "auto" takes the argument's value.
- A value given explicitly that disagrees with the argument it mirrors is an error listing every
  such key (transformers raises the same), except the ones transformers fills without checking
  (`scheduler.params.warmup_min_lr`, the hidden-size-based sizes).
- `zero_optimization.reduce_bucket_size` = hidden^2 and, at stage 3,
  `stage3_prefetch_bucket_size` = int(0.9 hidden^2) and
  `stage3_param_persistence_threshold` = 10 hidden, from `model.config.hidden_size` (or the
  largest of `hidden_sizes`, or the same of `text_config`); "auto" there without a hidden size
  is an error.
- `scheduler.params.total_num_steps` = the number of training steps and
  `scheduler.params.warmup_num_steps` = max(1, the Trainer's warmup steps).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import torch

from infinity.config import read_json

AUTO = "auto"


def read_config(config: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """A private copy of `config` (a dict, or the path of a JSON file)."""
    return copy.deepcopy(read_json(config))


class _Filler:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.mismatches: list[str] = []

    def node(self, key: str) -> tuple[dict[str, Any] | None, str]:
        *parents, leaf = key.split(".")
        node: Any = self.config
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        return (node if isinstance(node, dict) else None), leaf

    def is_auto(self, key: str) -> bool:
        node, leaf = self.node(key)
        return node is not None and node.get(leaf) == AUTO

    def fill(self, key: str, value: Any, argument: str | None = None) -> None:
        """ "auto" -> value; an explicit value unlike `value` is a mismatch (unless `argument`
        is None: fill only)."""
        node, leaf = self.node(key)
        if node is None:
            return
        if node.get(leaf) == AUTO:
            node[leaf] = value
        elif argument is not None and node.get(leaf) is not None and node[leaf] != value:
            self.mismatches.append(f"- {key}={node[leaf]} vs TrainingArguments {argument}={value}")


def fill_from_training_args(
    config: dict[str, Any], args: Any, model: torch.nn.Module, num_training_steps: int
) -> dict[str, Any]:
    """A copy of `config` with "auto" filled from `args` (a transformers TrainingArguments),
    `model` and the run's `num_training_steps`; see the module docstring. Raises ValueError
    listing the explicit values that disagree with the arguments."""
    filler = _Filler(copy.deepcopy(config))
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    filler.fill("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    filler.fill("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    filler.fill(
        "train_batch_size", args.world_size * micro * accumulation, "train_batch_size (calculated)"
    )
    filler.fill("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    filler.fill("optimizer.params.lr", args.learning_rate, "learning_rate")
    filler.fill(
        "optimizer.params.betas", [args.adam_beta1, args.adam_beta2], "adam_beta1+adam_beta2"
    )
    filler.fill("optimizer.params.eps", args.adam_epsilon, "adam_epsilon")
    filler.fill("optimizer.params.weight_decay", args.weight_decay, "weight_decay")
    filler.fill("scheduler.params.warmup_min_lr", 0)
    filler.fill("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    filler.fill("fp16.enabled", bool(args.fp16 or args.fp16_full_eval), "fp16|fp16_full_eval")
    filler.fill("bf16.enabled", bool(args.bf16 or args.bf16_full_eval), "bf16|bf16_full_eval")
    _fill_sizes(filler, model)
    filler.fill(
        "scheduler.params.total_num_steps", num_training_steps, "num_training_steps (calculated)"
    )
    filler.fill(
        "scheduler.params.warmup_num_steps",
        max(1, args.get_warmup_steps(num_training_steps)),
        "warmup_steps",
    )
    if filler.mismatches:
        raise ValueError(
            'the DeepSpeed config disagrees with the TrainingArguments (set these to "auto"):\n'
            + "\n".join(filler.mismatches)
        )
    return filler.config


def _fill_sizes(filler: _Filler, model: torch.nn.Module) -> None:
    keys = [
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
    ]
    auto = [key for key in keys if filler.is_auto(key)]
    if not auto:
        return
    hidden = _hidden_size(getattr(model, "config", None))
    if hidden is None:
        raise ValueError(
            f"the model's config has no hidden_size (nor hidden_sizes) to fill {auto}: give them "
            'numbers instead of "auto"'
        )
    filler.fill(keys[0], hidden * hidden)
    if (filler.config.get("zero_optimization") or {}).get("stage") == 3:
        filler.fill(keys[1], int(0.9 * hidden * hidden))
        filler.fill(keys[2], 10 * hidden)


def _hidden_size(model_config: Any) -> int | None:
    for node in (model_config, getattr(model_config, "text_config", None)):
        if node is None:
            continue
        if getattr(node, "hidden_size", None) is not None:
            return node.hidden_size
        if getattr(node, "hidden_sizes", None):
            return max(node.hidden_sizes)
    return None
