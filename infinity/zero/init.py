"""`zero.Init`: build a model whose parameters never exist whole in memory.

[Note: deferred parameters] Inside `with zero.Init(config):` every parameter a module registers
moves to the meta device at once (layers allocate untouched memory and initialise it on meta:
nothing becomes resident), and is marked as deferred. `initialize` then creates the values unit
by unit straight into the store (`create_units`): each owning module's parameters get fresh
memory, its initialiser runs (the model's `_init_weights(module)` for a `transformers` model,
else the module's `reset_parameters()`), the unit is flattened into the store and the memory
is freed before the next. Peak memory is one module, beside the store's own tiers. The values
follow the same initialisers as an eager build, not the same random stream.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from infinity.store import TensorStore, Tier
from infinity.zero.ranks import Partition
from infinity.zero.unit import FetchUnit, ParamSlot, store_unit

logger = logging.getLogger(__name__)

_DEFERRED = "_infinity_deferred"  # attribute set on a meta Parameter made under Init


@contextlib.contextmanager
def parameters_on_meta(*, deferred: bool = False) -> Iterator[None]:
    """Within the block, each parameter a module registers moves to the meta device at once
    (with `deferred`, marked for `create_units`). Not thread-safe: it patches
    nn.Module.register_parameter for the duration, as accelerate's init_empty_weights does."""
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            meta = type(param)(param.to("meta"), requires_grad=param.requires_grad)
            if deferred:
                setattr(meta, _DEFERRED, True)
            module._parameters[name] = meta

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


class Init:
    """`with infinity.zero.Init(config):` around model construction: parameters are created
    by `initialize` directly into the store, unit by unit (see [Note: deferred parameters]).

    `config` is accepted for DeepSpeed's signature (`deepspeed.zero.Init(config_dict_or_path=)`);
    the config given to `initialize` decides where the parameters go.
    """

    def __init__(self, config: Any = None, *, enabled: bool = True) -> None:
        self.config = config
        self.enabled = enabled
        self._context: contextlib.AbstractContextManager | None = None

    def __enter__(self) -> Init:
        if self.enabled:
            self._context = parameters_on_meta(deferred=True)
            self._context.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._context is not None:
            self._context.__exit__(*exc)
            self._context = None


def is_deferred(model: torch.nn.Module) -> bool:
    """Whether `model` has parameters built under Init that hold no values yet."""
    return any(getattr(p, _DEFERRED, False) and p.device.type == "meta" for p in model.parameters())


def create_units(model: torch.nn.Module, units: list[FetchUnit], store: TensorStore, *, home: Tier,
                 device: torch.device, partition: Partition | None = None) -> None:
    """Create the values of deferred parameters unit by unit into `store` (at home on `home`;
    see `put_unit` for `partition`) and leave empty placeholders (on `device`); see
    [Note: deferred parameters].

    Raises ValueError naming a module that has deferred parameters but no initialiser.
    """
    # meta param -> where it is registered
    holders: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    # meta param -> first module holding it (its initialiser)
    owner: dict[int, torch.nn.Module] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((module, name))
                owner.setdefault(id(p), module)
    slot_of = {id(s.param): s for u in units for s in u.slots}
    order = [(unit, list(dict.fromkeys(owner[id(s.param)] for s in unit.slots))) for unit in units]
    initialise = getattr(model, "_init_weights", None)
    names = {m: n for n, m in model.named_modules()}
    for module in {m for _, modules in order for m in modules}:
        if initialise is None and not hasattr(module, "reset_parameters"):
            raise ValueError(f"module {names[module] or '<root>'!r} ({type(module).__name__}) "
                             "was built under zero.Init but has no reset_parameters(): "
                             "its parameters cannot be created")
    placeholders: dict[torch.dtype, torch.Tensor] = {}
    for unit, modules in order:
        for module in modules:
            if not _materialise(module, holders, slot_of):
                continue  # created with an earlier unit (a parameter of it is in a resident unit)
            if initialise is not None:
                initialise(module)
            else:
                module.reset_parameters()
        store_unit(store, unit, torch.cat([s.param.detach().reshape(-1)
                                           for s in unit.slots]).to(unit.dtype),
                   home, partition, placeholders, device)
    logger.info("zero.Init: %d units created into the %s tier", len(units), home.label)


def _materialise(module: torch.nn.Module, holders: dict[int, list[tuple[torch.nn.Module, str]]],
                 slot_of: dict[int, ParamSlot]) -> bool:
    """Give `module`'s meta parameters fresh CPU memory (a meta tensor cannot take .data from
    another device: the Parameter is replaced in every module holding it and in its slot).
    False when it had none left (its parameters were created with an earlier unit)."""
    metas = [p for p in module._parameters.values() if p is not None and p.device.type == "meta"]
    for p in metas:
        fresh = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                   requires_grad=p.requires_grad)
        for holder, name in holders.pop(id(p), []):
            holder._parameters[name] = fresh
        slot = slot_of.pop(id(p), None)
        if slot is not None:
            slot.param = fresh
    return bool(metas)


def buffers_to(model: torch.nn.Module, device: torch.device) -> None:
    """Move every buffer to `device` (model.to() would also try the meta parameters)."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)
