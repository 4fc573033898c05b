"""Which dtype the model computes in, and which its parameters are stored in.

bf16 storage halves NVMe traffic and memory, but on CPUs without bf16 units (no AVX512-BF16
or AMX) torch's bf16 matmul runs at about 1 GFLOP/s against 100+ in fp32. There the units are
stored in bf16 and upcast to fp32 when fetched; "auto" decides from the CPU flags.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from infinity.errors import ConfigError

logger = logging.getLogger(__name__)

_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


class Precision(NamedTuple):
    compute: torch.dtype  # the model's parameters while fetched, activations, gradients
    storage: torch.dtype | None  # the units' values in the store (None: the compute dtype)


def cpu_has_bf16_units(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """True when the CPU advertises AVX512-BF16 or AMX-BF16 (False where it cannot be read)."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), [])
    except OSError:
        return False
    return any(flag in flags for flag in _BF16_CPU_FLAGS)


def choose_precision(*, fp16: bool, bf16: bool, compute_dtype: str, accelerator: bool,
                     bf16_units: bool) -> Precision:
    """The precision plan from the config (`fp16.enabled`, `bf16.enabled`,
    `infinity.compute_dtype`) and the machine; logs the choice once for bf16."""
    if fp16:
        if compute_dtype not in ("auto", "fp16"):
            raise ConfigError(f"infinity.compute_dtype = {compute_dtype!r} with fp16 enabled; "
                              "allowed: \"auto\" or \"fp16\"")
        return Precision(torch.float16, None)
    if not bf16:
        if compute_dtype not in ("auto", "fp32"):
            raise ConfigError(f"infinity.compute_dtype = {compute_dtype!r} without bf16 or fp16 "
                              "enabled; allowed: \"auto\" or \"fp32\"")
        return Precision(torch.float32, None)
    if compute_dtype not in ("auto", "fp32", "bf16"):
        raise ConfigError(f"infinity.compute_dtype = {compute_dtype!r} with bf16 enabled; "
                          "allowed: \"auto\", \"bf16\" or \"fp32\"")
    fast = accelerator or bf16_units
    upcast = compute_dtype == "fp32" or (compute_dtype == "auto" and not fast)
    logger.info("bf16 parameters compute in %s (%s)", "fp32" if upcast else "bf16",
                "infinity.compute_dtype" if compute_dtype != "auto" else
                "accelerator" if accelerator else
                "CPU has bf16 units" if bf16_units else
                "CPU has no bf16 units: bf16 matmul is slow here")
    return Precision(torch.float32, torch.bfloat16) if upcast else Precision(torch.bfloat16, None)
