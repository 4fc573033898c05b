"""JSON dict -> a tree of checked values -> frozen sections.

Two passes, so "auto" can be filled in between (see _auto.py):
1. `read(cls, raw, path, notes)` checks every key against the section's fields (unknown key:
   ConfigError with the closest valid one), converts every value to the field's type, keeps
   "auto" as the AUTO marker, and returns a `Tree`.
2. `build(tree, path, notes)` turns a Tree into the section, replacing any AUTO left by the
   field's default (DeepSpeed's behaviour for "auto" it does not fill itself).
See [Note: config key paths] in _values.py.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field
from typing import Any

from infinity.config._section import Section
from infinity.config._values import AUTO, FieldError, convert, join, unknown_key_error
from infinity.errors import ConfigError


@dataclass
class Notes:
    """What load_config logs once: "auto" values filled, and keys accepted but not honoured."""

    filled: list[str] = field(default_factory=list)
    not_honoured: list[str] = field(default_factory=list)


@dataclass
class Tree:
    """One section's checked values: field name -> value, AUTO, or a nested Tree."""

    cls: type[Section]
    values: dict[str, Any]

    def get(self, *names: str) -> Any:
        """The value at a path of field names below this tree; None if absent."""
        node: Any = self
        for name in names:
            if not isinstance(node, Tree) or name not in node.values:
                return None
            node = node.values[name]
        return node


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _section_of(annotation: Any) -> type[Section] | None:
    """The Section class an annotation names (through `X | None`), or None for a plain value."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, Section):
            return candidate
    return None


def _valid_keys(cls: type[Section]) -> set[str]:
    names = {f.name for f in dataclasses.fields(cls)} - cls.INTERNAL
    return names | set(cls.ALIASES) | set(cls.OPAQUE)


def read(cls: type[Section], raw: Any, path: str, notes: Notes) -> Tree:
    """Check and convert one JSON object for section `cls` found at `path`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'the config'} = {raw!r}: a JSON object ({{...}}) is "
                          f"expected here")
    valid = _valid_keys(cls)
    values: dict[str, Any] = {}
    written_as: dict[str, str] = {}  # field -> the key (or alias) that set it
    # "type" first: it decides which class reads "params".
    for key in sorted(raw, key=lambda k: k != "type"):
        if not isinstance(key, str) or key not in valid:
            raise unknown_key_error(path, str(key), valid)
        where = join(path, key)
        if key in cls.OPAQUE:
            notes.not_honoured.append(f"{where} ({cls.OPAQUE[key]})")
            continue
        name = cls.ALIASES.get(key, key)
        if name in values:
            raise ConfigError(f"{join(path, name)} is given twice, as {join(path, key)} and as "
                              f"{join(path, written_as[name])}: keep one")
        written_as[name] = key
        if name in cls.NOT_HONOURED:
            notes.not_honoured.append(f"{where} ({cls.NOT_HONOURED[name]})")
        values[name] = _read_value(cls, name, raw[key], where, values, notes)
    if hasattr(cls, "params_class"):
        if "type" not in values:
            raise _missing_type(cls, path)
        values.setdefault("params", Tree(cls.params_class(values["type"]), {}))
    if cls.SECTION_REASON is not None and raw:
        notes.not_honoured.append(f"{path} ({cls.SECTION_REASON})")
    return Tree(cls, values)


def _missing_type(cls: type[Section], path: str) -> ConfigError:
    return ConfigError(f"{join(path, 'type')} is missing: {cls.type_error('')}")


def _read_value(cls: type[Section], name: str, value: Any, where: str, done: dict[str, Any],
                notes: Notes) -> Any:
    annotation = _hints(cls)[name]
    if hasattr(cls, "params_class"):
        if name == "type":
            canonical = cls.canonical_type(value) if isinstance(value, str) else None
            if canonical is None:
                raise FieldError(where, value, cls.type_error(str(value)))
            return canonical
        if name == "params":
            if "type" not in done:
                raise _missing_type(cls, where.rpartition(".")[0])
            return read(cls.params_class(done["type"]), value, where, notes)
    sub = _section_of(annotation)
    if isinstance(value, str) and value == "auto":
        if name in cls.NO_AUTO or sub is not None:
            raise FieldError(where, value, "an explicit value: \"auto\" is not allowed here")
        return AUTO
    if sub is not None:
        # null for a section means its defaults (DeepSpeed's Optional sections)
        return read(sub, {} if value is None else value, where, notes)
    return convert(value, annotation, where)


def build(tree: Tree, path: str, notes: Notes, **extra: Any) -> Section:
    """The frozen section for `tree`; AUTO left over becomes the field's default (noted)."""
    defaults = {f.name: f for f in dataclasses.fields(tree.cls)}
    kwargs: dict[str, Any] = dict(extra)
    for name, value in tree.values.items():
        where = join(path, name)
        if isinstance(value, Tree):
            kwargs[name] = build(value, where, notes)
        elif value is AUTO:
            spec = defaults[name]
            value = spec.default_factory() if spec.default is dataclasses.MISSING else spec.default
            notes.filled.append(f"{where}={value!r} (DeepSpeed default)")
            kwargs[name] = value
        else:
            kwargs[name] = value
    try:
        return tree.cls(**kwargs)
    except FieldError as exc:
        raise exc.under(path) from None
