"""Older or alternative places and spellings of DeepSpeed keys, rewritten before parsing.

The caller's dict is never modified: rewriting returns a shallow copy of what changes.
"""

from __future__ import annotations

from typing import Any

from infinity.config._parse import Notes
from infinity.config._values import FieldError
from infinity.errors import ConfigError

# DeepSpeed's deprecated ZeRO booleans -> (offload subsection, key, value when true)
_CPU_OFFLOAD = {"cpu_offload": ("offload_optimizer",), "cpu_offload_param": ("offload_param",)}


def hoist_nested_aio(raw: Any) -> tuple[Any, Any]:
    """The Hugging Face docs' ZeRO-Infinity example puts `aio` inside `zero_optimization`; take
    it from there as if it were at the top level. Returns (config, the nested aio or None)."""
    zero = raw.get("zero_optimization") if isinstance(raw, dict) else None
    if not isinstance(zero, dict) or "aio" not in zero:
        return raw, None
    if "aio" in raw:
        raise ConfigError("aio is given twice, at the top level and as zero_optimization.aio: "
                          "keep one")
    rest = {key: value for key, value in zero.items() if key != "aio"}
    return {**raw, "zero_optimization": rest}, zero["aio"]


def translate_cpu_offload(raw: Any, notes: Notes) -> Any:
    """DeepSpeed's deprecated `cpu_offload`, `cpu_offload_param` and `cpu_offload_use_pin_memory`
    become `offload_optimizer` / `offload_param` with device "cpu" (and their pin_memory)."""
    zero = raw.get("zero_optimization") if isinstance(raw, dict) else None
    legacy = [key for key in (*_CPU_OFFLOAD, "cpu_offload_use_pin_memory")
              if isinstance(zero, dict) and key in zero]
    if not legacy:
        return raw
    zero = {key: value for key, value in zero.items() if key not in legacy}
    pin = raw["zero_optimization"].get("cpu_offload_use_pin_memory")
    if pin is not None and not isinstance(pin, bool):
        raise FieldError("zero_optimization.cpu_offload_use_pin_memory", pin, "true or false")
    for key, (section,) in _CPU_OFFLOAD.items():
        value = raw["zero_optimization"].get(key)
        if value is None:
            continue
        if not isinstance(value, bool):
            raise FieldError(f"zero_optimization.{key}", value, "true or false")
        if section in zero:
            raise ConfigError(f"zero_optimization.{key} (deprecated) and "
                              f"zero_optimization.{section} are both given: keep {section}")
        if value:
            zero[section] = {"device": "cpu", **({} if pin is None else {"pin_memory": pin})}
            notes.filled.append(f"zero_optimization.{section}.device='cpu' (from the deprecated "
                                f"zero_optimization.{key})")
    return {**raw, "zero_optimization": zero}
