"""What an engine's parameters are, without reading them: `parameter_specs` lists names, shapes
and stored dtypes, so a writer can plan its files (safetensors shards) before the values arrive
from `Engine.named_parameters(select)` (one fetch unit at a time, only the units holding a
selected name read)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infinity.engine._engine import Engine


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
    """Every parameter in the order `Engine.named_parameters` yields them; no I/O."""
    return [ParamSpec(s.name, s.shape, u.dtype, u.requires_grad)
            for u in engine.units for s in u.slots]
