"""The few configuration values the engine reads, until infinity.config lands.

# TODO(#7): use infinity.config (typed sections, validation, "auto") and delete this module.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from infinity.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class Settings:
    """What the engine needs, with DeepSpeed's defaults."""

    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    adamw_mode: bool = True
    fp16: bool = False
    bf16: bool = False
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0
    stage: int = 0
    offload_param: str = "none"
    offload_optimizer: str = "none"
    nvme_path: str | None = None
    prefetch_bucket_numel: int = 50_000_000
    max_live_numel: int = 1_000_000_000
    max_reuse_numel: int = 1_000_000_000
    persistence_numel: int = 100_000
    sub_group_size: int = 1_000_000_000
    host_memory_budget: int | None = None


def read_settings(config: dict[str, Any] | str | os.PathLike[str]) -> Settings:
    """Read the keys the engine uses from a DeepSpeed config dict or JSON file."""
    if not isinstance(config, dict):
        with open(config) as f:
            config = json.load(f)
    zero = config.get("zero_optimization", {})
    optimizer = config.get("optimizer", {"type": "AdamW", "params": {}})
    kind = str(optimizer.get("type", "AdamW")).lower()
    if kind not in ("adam", "adamw"):
        raise ConfigError(f"optimizer.type {optimizer.get('type')!r}: the engine runs Adam or AdamW")
    params = optimizer.get("params", {})
    offload_param = zero.get("offload_param") or {}
    offload_opt = zero.get("offload_optimizer") or {}
    fp16 = config.get("fp16", {})
    return Settings(
        gradient_accumulation_steps=int(config.get("gradient_accumulation_steps", 1)),
        gradient_clipping=float(config.get("gradient_clipping", 0.0)),
        lr=float(params.get("lr", 1e-3)),
        betas=tuple(float(b) for b in params.get("betas", (0.9, 0.999))),
        eps=float(params.get("eps", 1e-8)),
        weight_decay=float(params.get("weight_decay", 0.0)),
        adamw_mode=kind == "adamw" or bool(params.get("adam_w_mode", True)),
        fp16=bool(fp16.get("enabled", False)),
        bf16=bool(config.get("bf16", {}).get("enabled", False)),
        initial_scale_power=int(fp16.get("initial_scale_power", 16)),
        loss_scale_window=int(fp16.get("loss_scale_window", 1000)),
        hysteresis=int(fp16.get("hysteresis", 2)),
        min_loss_scale=float(fp16.get("min_loss_scale", 1.0)),
        stage=int(zero.get("stage", 0)),
        offload_param=str(offload_param.get("device", "none")),
        offload_optimizer=str(offload_opt.get("device", "none")),
        nvme_path=offload_param.get("nvme_path") or offload_opt.get("nvme_path"),
        prefetch_bucket_numel=int(float(zero.get("stage3_prefetch_bucket_size", 5e7))),
        max_live_numel=int(float(zero.get("stage3_max_live_parameters", 1e9))),
        max_reuse_numel=int(float(zero.get("stage3_max_reuse_distance", 1e9))),
        persistence_numel=int(float(zero.get("stage3_param_persistence_threshold", 1e5))),
        sub_group_size=int(float(zero.get("sub_group_size", 1e9))),
        host_memory_budget=config.get("infinity", {}).get("host_memory_budget"),
    )
