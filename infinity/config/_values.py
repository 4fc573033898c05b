"""Turning one JSON value into the type a config field declares, with errors naming the key.

[Note: config key paths] Every error carries the dotted path of the culprit as the user wrote
it in the JSON (`zero_optimization.offload_param.nvme_path`). A section's `__post_init__` only
knows its own field names, so it raises `FieldError` with the bare name and the builder, which
knows where the section sits, prefixes the path.
"""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from typing import Any, Literal, NewType

from infinity.errors import ConfigError

ByteSize = NewType("ByteSize", int)
"""An int of bytes that may be written as a string with a unit ("8GB", "512MiB")."""


class _Auto:
    """The JSON value "auto": filled later from the model, the machine or the Trainer defaults."""

    _instance: _Auto | None = None

    def __new__(cls) -> _Auto:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return '"auto"'


AUTO = _Auto()


class FieldError(ConfigError):
    """A value a section refused; `key` grows into the full path as it travels up the builder."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key} = {value!r}; allowed: {allowed}")

    def under(self, prefix: str) -> FieldError:
        """The same error with the key path of the section in front."""
        return FieldError(f"{prefix}.{self.key}" if prefix else self.key, self.value, self.allowed)


def check(ok: bool, key: str, value: Any, allowed: str) -> None:
    """Raise FieldError(key, value, allowed) unless ok; the idiom of every __post_init__."""
    if not ok:
        raise FieldError(key, value, allowed)


def join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def unknown_key_error(path: str, key: str, valid: typing.Iterable[str]) -> ConfigError:
    """'unknown key a.b.nvme_pth; did you mean a.b.nvme_path?' (difflib's closest valid key)."""
    valid = sorted(valid)
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    hint = f"; did you mean {join(path, close[0])!r}?" if close else \
        f"; valid keys here: {', '.join(valid)}"
    return ConfigError(f"unknown config key {join(path, key)!r}{hint}")


# -- converters: JSON value -> declared type ---------------------------------------------------

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
          "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: str) -> int:
    """'8GB' -> 8e9, '512MiB' -> 512 * 2**20, '4G' -> 4 * 2**30 (a bare K/M/G/T is binary, as in
    tools/); raises ValueError for anything else."""
    match = _SIZE.match(text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(text)
    nbytes = float(match.group(1)) * _UNITS[unit]
    if not nbytes.is_integer():
        raise ValueError(text)
    return int(nbytes)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _to_int(value: Any, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)  # 1e9 and 5e8 are how DeepSpeed configs write counts
    raise FieldError(key, value, "a whole number (an integer, or a float such as 1e9)")


def _to_float(value: Any, key: str) -> float:
    if _is_number(value) and math.isfinite(value):
        return float(value)
    raise FieldError(key, value, "a finite number")


def _to_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    raise FieldError(key, value, "true or false (a JSON boolean)")


def _to_str(value: Any, key: str) -> str:
    if isinstance(value, str):
        return value
    raise FieldError(key, value, "a string")


def _to_bytes(value: Any, key: str) -> int:
    if isinstance(value, str):
        try:
            return parse_bytes(value)
        except ValueError:
            raise FieldError(key, value, 'a byte count: an integer or a string such as "8GB", '
                             '"512MiB" or "4G" (KB/MB/GB decimal, KiB/MiB/GiB and K/M/G '
                             'binary)') from None
    return _to_int(value, key)


def _to_pair(value: Any, key: str) -> tuple[float, float]:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return (_to_float(value[0], f"{key}[0]"), _to_float(value[1], f"{key}[1]"))
    raise FieldError(key, value, "a list of two numbers, e.g. [0.9, 0.999]")


_SCALARS = {int: _to_int, float: _to_float, bool: _to_bool, str: _to_str, ByteSize: _to_bytes,
            tuple[float, float]: _to_pair}


def convert(value: Any, annotation: Any, key: str) -> Any:
    """`value` as `annotation` (int, float, bool, str, ByteSize, Literal, unions of them with
    None, a pair).

    Raises FieldError naming `key`, the value and what is allowed.
    """
    if annotation in _SCALARS:
        return _SCALARS[annotation](value, key)
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        if value in choices and type(value) is type(choices[0]):
            return value
        raise FieldError(key, value, f"one of {', '.join(repr(c) for c in choices)}")
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if value is None:
            return None
        if len(args) == 1:
            return convert(value, args[0], key)
        allowed = []
        for arg in args:  # the first that takes it
            try:
                return convert(value, arg, key)
            except FieldError as exc:
                allowed.append(exc.allowed)
        raise FieldError(key, value, ", or ".join(allowed) + ", or null")
    raise TypeError(f"config field {key} has an annotation the parser does not know: {annotation}")
