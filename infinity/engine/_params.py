"""Streaming parameters out of an engine one fetch unit at a time (export, inspection), with
only the units that hold a wanted name read from the store.

`parameter_specs` lists names, shapes and stored dtypes without reading anything, so a writer can
plan its files (safetensors shards) before the values arrive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from infinity.engine._engine import Engine, _unit_values


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter as the store holds it."""

    name: str  # qualified name (the first module holding it, as in named_parameters)
    shape: torch.Size
    dtype: torch.dtype  # stored dtype (bf16 storage stays bf16 even when computing in fp32)
    requires_grad: bool

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


def parameter_specs(engine: Engine) -> list[ParamSpec]:
    """Every parameter in the order `iter_parameters` yields them; no I/O."""
    return [ParamSpec(s.name, s.shape, u.dtype, u.requires_grad) for u in engine.units for s in u.slots]


def iter_parameters(engine: Engine, select: Callable[[str], bool] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, copy of its current values in the stored dtype) for the parameters `select`
    accepts (all without it), one unit at a time: at most one unit's values are held here, and a
    unit with no selected parameter is not read. Call between steps (units are released first)."""
    engine._check_open()
    engine.synchronize()
    engine.coordinator.release_all()
    for unit in engine.units:
        if select is None or any(select(s.name) for s in unit.slots):
            for name, values in _unit_values(engine.store, unit, engine._ranked):
                if select is None or select(name):
                    yield name, values
