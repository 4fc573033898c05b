"""Filling "auto" the way the Hugging Face Trainer's DeepSpeed integration does.

Where the Trainer would fill a value from its arguments, its defaults are used (lr 5e-5, betas
(0.9, 0.999), eps 1e-8, weight decay 0, clipping 1.0, no warmup); the bucket sizes follow the
model's hidden size as the integration computes them; the host memory budget follows the machine.
Batch sizes follow DeepSpeed's rule (any two of the three determine the third); what is still
unknown waits for the first batch. Every filled value is recorded in `Notes.filled`.
"""

from __future__ import annotations

from typing import Any

import torch

from infinity.config._machine import available_memory_bytes
from infinity.config._parse import Notes, Tree
from infinity.config._values import AUTO, FieldError

TRAINER_DEFAULTS = {"lr": 5e-5, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
TRAINER_CLIP = 1.0
TRAINER_WARMUP_STEPS = 0
BUDGET_SHARE = 0.8  # of the memory available at load: the rest is the process and the OS


def hidden_size_of(model: torch.nn.Module | None) -> int | None:
    """`model.config.hidden_size` (or the largest of `hidden_sizes`), as the integration reads."""
    model_config = getattr(model, "config", None)
    size = getattr(model_config, "hidden_size", None)
    if size is None and getattr(model_config, "hidden_sizes", None):
        size = max(model_config.hidden_sizes)
    return size if isinstance(size, int) and size > 0 else None


def _fill(tree: Tree | None, name: str, value: Any, where: str, source: str,
          notes: Notes) -> None:
    """Replace AUTO at tree.values[name] by value, noting it."""
    if tree is not None and tree.values.get(name) is AUTO:
        tree.values[name] = value
        notes.filled.append(f"{where}={value!r} ({source})")


def fill_auto(tree: Tree, *, model: torch.nn.Module | None, notes: Notes) -> None:
    """Resolve the "auto" values that have a rule; build() gives the rest DeepSpeed's default."""
    params = tree.get("optimizer", "params")
    for name, value in TRAINER_DEFAULTS.items():
        _fill(params, name, value, f"optimizer.params.{name}", "Trainer default", notes)
    _fill(tree, "gradient_clipping", TRAINER_CLIP, "gradient_clipping", "Trainer default", notes)

    lr = tree.get("optimizer", "params", "lr")
    sched = tree.get("scheduler", "params")
    _fill(sched, "warmup_min_lr", 0.0, "scheduler.params.warmup_min_lr", "Trainer default", notes)
    _fill(sched, "warmup_max_lr", lr if isinstance(lr, float) else TRAINER_DEFAULTS["lr"],
          "scheduler.params.warmup_max_lr", "the optimizer's lr", notes)
    _fill(sched, "warmup_num_steps", TRAINER_WARMUP_STEPS, "scheduler.params.warmup_num_steps",
          "Trainer default", notes)
    _fill(sched, "total_num_steps", None, "scheduler.params.total_num_steps",
          "unknown until the schedule is built: give total_num_steps then", notes)

    for section in ("fp16", "bf16", "amp"):
        _fill(tree.get(section), "enabled", False, f"{section}.enabled", "Trainer default", notes)

    zero = tree.get("zero_optimization")
    hidden = hidden_size_of(model)
    if hidden is not None:
        source = f"model hidden_size {hidden}"
        _fill(zero, "reduce_bucket_size", hidden * hidden, "zero_optimization.reduce_bucket_size",
              source, notes)
        _fill(zero, "stage3_prefetch_bucket_size", int(0.9 * hidden * hidden),
              "zero_optimization.stage3_prefetch_bucket_size", source, notes)
        _fill(zero, "stage3_param_persistence_threshold", 10 * hidden,
              "zero_optimization.stage3_param_persistence_threshold", source, notes)

    own = tree.get("infinity")
    if own is not None and own.values.get("host_memory_budget") in (None, AUTO):
        own.values["host_memory_budget"] = AUTO
        _fill(own, "host_memory_budget", int(BUDGET_SHARE * available_memory_bytes()),
              "infinity.host_memory_budget", f"{BUDGET_SHARE:.0%} of available memory", notes)


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu",
               "gradient_accumulation_steps")


def fill_batch(tree: Tree, world_size: int, notes: Notes) -> None:
    """DeepSpeed's batch rule: any two of the three determine the third (integer division, then
    the product is checked by Config); with only one, accumulation is 1; with none, the
    micro-batch waits for the first batch. "auto" counts as not given."""
    values = tree.values
    given = {k: values.get(k) for k in _BATCH_KEYS if values.get(k) not in (None, AUTO)}
    tbs = given.get("train_batch_size")
    micro = given.get("train_micro_batch_size_per_gpu")
    gas = given.get("gradient_accumulation_steps")
    for key, value in given.items():
        if value <= 0:
            raise FieldError(key, value, "an integer > 0")
    if world_size < 1:
        raise FieldError("world_size", world_size, "an integer >= 1 (load_config argument)")
    if tbs is not None and micro is not None and gas is None:
        gas = max(1, tbs // micro // world_size)
    elif tbs is not None and gas is not None and micro is None:
        micro = max(1, tbs // world_size // gas)
    elif micro is not None and gas is not None and tbs is None:
        tbs = micro * gas * world_size
    elif tbs is not None and micro is None and gas is None:
        gas, micro = 1, max(1, tbs // world_size)
    elif micro is not None and tbs is None and gas is None:
        gas, tbs = 1, micro * world_size
    elif gas is None:
        gas = 1
    resolved = {"train_batch_size": tbs, "train_micro_batch_size_per_gpu": micro,
                "gradient_accumulation_steps": gas}
    for key, value in resolved.items():
        if key in given:
            continue
        if value is None:
            source = "from the first batch"
        elif key == "gradient_accumulation_steps" and len(given) < 2:
            source = "default"
        else:
            source = "derived: batch = micro * accumulation * world_size"
        notes.filled.append(f"{key}={value!r} ({source})")
        values[key] = value
