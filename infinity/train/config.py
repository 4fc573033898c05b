"""The DeepSpeed config of a run: the --config file (or the shipped default), then the
command-line options on top of it.

What the options set: the micro-batch and accumulation (dropping `train_batch_size`, which
follows from them), the optimizer's lr and weight decay, gradient clipping, the host memory
budget (the shipped config says "auto": a share of the memory available), the precision (a
bf16 model trains in bf16 where the machine computes bf16 fast, unless the config or a flag
says otherwise), the learning-rate schedule (--schedule, --warmup; a scheduler whose
`total_num_steps` is "auto" or absent takes --steps), and the NVMe paths.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
from collections.abc import Callable
from typing import Any

import torch

from infinity.engine import cpu_has_bf16_units
from infinity.errors import InputError
from infinity.train import models

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 8
MICRO = "train_micro_batch_size_per_gpu"
ACCUMULATION = "gradient_accumulation_steps"
SCHEDULES = {"constant": "WarmupLR", "linear": "WarmupDecayLR", "cosine": "WarmupCosineLR"}
PRECISIONS = ("bf16", "fp32")
MOMENTS = ("fp32", "bf16", "int8")  # --optimizer-state: infinity.optimizer_state.moments
MONITORS = ("tensorboard", "csv_monitor", "wandb")  # DeepSpeed's metric writer sections


def bf16_is_fast() -> bool:
    """Whether this machine computes bf16 at full speed: an accelerator, or a CPU with bf16
    units (AVX512-BF16, AMX)."""
    return torch.cuda.is_available() or cpu_has_bf16_units()


def read_config(path: str | None) -> dict[str, Any]:
    """The --config file as a dict, or the shipped default."""
    if path is None:
        return json.loads((models.DEFAULTS / "ds_config.json").read_text())
    try:
        config = json.loads(pathlib.Path(path).read_text())
    except OSError as e:
        raise InputError(f"--config {path}: {e.strerror}") from None
    except (ValueError, RecursionError) as e:  # not JSON, or not UTF-8
        raise InputError(f"--config {path}: not JSON ({e})") from None
    if not isinstance(config, dict):
        raise InputError(f"--config {path}: not a JSON object")
    return config


def warmup_steps(text: str | float | int | None, steps: int) -> int | None:
    """--warmup: a whole number is steps, a fraction below 1 (0.05) a share of --steps."""
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    whole = value.is_integer() and "." not in str(text)
    if value < 0 or not (whole or value < 1):
        raise InputError(f"--warmup {text}: steps (a whole number >= 0) or a share of --steps "
                         "below 1 (e.g. 0.05)")
    return int(value) if whole else round(value * steps)


def model_dtype(directory: str | None) -> torch.dtype:
    """The dtype --model's config.json declares (the built-in model is fp32)."""
    if directory is None:
        return torch.float32
    try:
        fields = json.loads((pathlib.Path(directory) / "config.json").read_bytes())
    except (OSError, ValueError, RecursionError):
        return torch.float32  # load_model says what is wrong
    name = fields.get("dtype") or fields.get("torch_dtype") if isinstance(fields, dict) else None
    return getattr(torch, name, torch.float32) if isinstance(name, str) else torch.float32


def set_precision(config: dict[str, Any], flag: str | None, dtype: torch.dtype) -> None:
    """--bf16 / --fp32 when given; else a config that says nothing about bf16 or fp16 trains a
    bf16 model in bf16 where the machine computes bf16 fast (an accelerator, or a CPU with
    bf16 units), in fp32 elsewhere (bf16 matmul is slow there)."""
    if flag is not None:
        if flag not in PRECISIONS:
            raise InputError(f"precision {flag}: choose one of {', '.join(PRECISIONS)}")
        config.setdefault("fp16", {})["enabled"] = False
        config.setdefault("bf16", {})["enabled"] = flag == "bf16"
        return
    said = any(isinstance(config.get(k), dict) and config[k].get("enabled") not in (None, "auto")
               for k in ("bf16", "fp16"))
    if said or dtype != torch.bfloat16:
        return
    fast = bf16_is_fast()
    logger.info("a bf16 model: trains in %s (%s; --bf16 or --fp32 to choose)",
                "bf16" if fast else "fp32", "this machine computes bf16 fast" if fast else
                "this CPU has no bf16 units: bf16 matmul is slow here")
    if fast:
        config.setdefault("bf16", {})["enabled"] = True


def set_optimizer_state(config: dict[str, Any], moments: str | None, no_master: bool) -> None:
    """--optimizer-state and --no-master into infinity.optimizer_state (after the precision is
    settled: without a master the parameters must be 16-bit)."""
    if moments is None and not no_master:
        return
    if moments is not None and moments not in MOMENTS:
        raise InputError(f"--optimizer-state {moments}: choose one of {', '.join(MOMENTS)}")
    if no_master and not any(isinstance(config.get(k), dict) and config[k].get("enabled") is True
                             for k in ("bf16", "fp16")):
        raise InputError("--no-master: this run trains in fp32, whose parameters are their own "
                         "master; add --bf16 (or a config with bf16 or fp16 enabled)")
    state = config.setdefault("infinity", {}).setdefault("optimizer_state", {})
    if moments is not None:
        state["moments"] = moments
    if no_master:
        state["master"] = "none"


def set_schedule(config: dict[str, Any], schedule: str | None, warmup: int | None,
                 steps: int) -> None:
    """--schedule replaces the config's scheduler, --warmup sets its warmup (a warmup alone
    means a constant schedule after it); a total_num_steps that is "auto" or absent is
    --steps."""
    if schedule is not None:
        if schedule not in SCHEDULES:
            raise InputError(f"--schedule {schedule}: choose one of {', '.join(SCHEDULES)}")
        config["scheduler"] = _scheduler(SCHEDULES[schedule])
    elif warmup is not None and not isinstance(config.get("scheduler"), dict):
        config["scheduler"] = _scheduler(SCHEDULES["constant"])
    scheduler = config.get("scheduler")
    if not isinstance(scheduler, dict):
        return
    params = scheduler.setdefault("params", {})
    if not isinstance(params, dict):
        return  # the engine names what is wrong
    if warmup is not None:
        params["warmup_num_steps"] = warmup
        params.setdefault("warmup_type", "linear")  # as --help says (DeepSpeed's default: log)
    if scheduler.get("type") != "WarmupLR" and params.get("total_num_steps") in (None, "auto"):
        params["total_num_steps"] = steps


def _scheduler(kind: str) -> dict[str, Any]:
    """A scheduler section of `kind` whose top learning rate is the optimizer's (WarmupLR and
    WarmupDecayLR default to 1e-3 otherwise; WarmupCosineLR scales the optimizer's)."""
    return {"type": kind, "params": {} if kind == "WarmupCosineLR" else
            {"warmup_min_lr": 0, "warmup_max_lr": "auto"}}


def ds_config(options: Any, nvme_dir: Callable[[], str]) -> dict[str, Any]:
    """The config file (or the shipped default) with the command-line options on top; an NVMe
    offload without nvme_path gets `nvme_dir()`; --nvme-path replaces any nvme_path."""
    config = read_config(options.config)
    micro = config.get(MICRO, "auto")
    if options.batch_size is not None and options.batch_size < 1:
        raise InputError(f"--batch-size {options.batch_size}: must be at least 1")
    if options.batch_size is not None or micro == "auto":
        config[MICRO] = options.batch_size or DEFAULT_BATCH_SIZE
        config.pop("train_batch_size", None)  # follows from micro batch x accumulation
    elif (isinstance(micro, bool) or not isinstance(micro, int | float)
          or not float(micro).is_integer() or micro < 1):
        raise InputError(f"--config {options.config}: {MICRO} is {micro!r}; give a whole "
                         f"number >= 1 (or \"auto\")")
    else:
        config[MICRO] = int(micro)
    if options.grad_accum is not None:
        if options.grad_accum < 1:
            raise InputError(f"--grad-accum {options.grad_accum}: must be at least 1")
        config[ACCUMULATION] = options.grad_accum
        config.pop("train_batch_size", None)
    optimizer_params = {"lr": options.lr, "weight_decay": options.weight_decay}
    if any(v is not None for v in optimizer_params.values()):
        optimizer = config.setdefault("optimizer", {"type": "AdamW", "params": {}})
        optimizer.setdefault("params", {}).update(
            {k: v for k, v in optimizer_params.items() if v is not None})
    if options.clip is not None:
        config["gradient_clipping"] = options.clip
    if options.host_memory is not None:
        config.setdefault("infinity", {})["host_memory_budget"] = options.host_memory
    set_precision(config, options.precision, model_dtype(options.model))
    set_optimizer_state(config, options.optimizer_state, options.no_master)
    set_schedule(config, options.schedule, warmup_steps(options.warmup, options.steps),
                 options.steps)
    zero = config.setdefault("zero_optimization", {})
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key)
        if isinstance(section, dict) and section.get("device") == "nvme":
            if options.nvme_path is not None or not section.get("nvme_path"):
                section["nvme_path"] = nvme_dir()
    return config


def take_monitors(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Remove DeepSpeed's metric writer sections that are enabled, for the job to honour (or
    warn about); the engine has no metrics writer."""
    return {k: config.pop(k) for k in MONITORS
            if isinstance(config.get(k), dict) and config[k].get("enabled") is True}


def keep_room_for_export(config: dict[str, Any], output: pathlib.Path, nbytes: int) -> None:
    """Where --output is on the disk of an nvme_path, the swap file leaves the export's `nbytes`
    free there (infinity.nvme_keep_free, unless the config sets it): a run that trains for hours
    must not then find no room for its model."""
    keep = config.get("infinity", {})
    zero = config.get("zero_optimization", {})
    if not isinstance(keep, dict) or not isinstance(zero, dict) or "nvme_keep_free" in keep:
        return  # (a section that is no object: the engine names it)
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key)
        if not (isinstance(section, dict) and section.get("device") == "nvme"
                and isinstance(section.get("nvme_path"), str) and section["nvme_path"]):
            continue
        try:
            same_disk = os.stat(section["nvme_path"]).st_dev == output.stat().st_dev
        except OSError:  # not made yet: the engine names a bad nvme_path
            continue
        if same_disk:
            config["infinity"] = {**keep, "nvme_keep_free": nbytes}
            return
