"""Real values in the parameters of a model in the store for the length of a block, and changes
made there written back (DeepSpeed's `zero.GatheredParameters`).

`track(engine)` (at `initialize`) remembers which engine holds each parameter, so a block names
parameters only. Entering: the last step's optimizer work is waited for, every unit is
released, the units holding the named parameters are read (gathered from the ranks at stage
3) and each named parameter's `.data` becomes a copy of its values. Leaving with a modifier
rank: that rank's values (broadcast to the others) are written into the store, then every
parameter gets its empty placeholder back. Every rank enters the block with the same
parameters, as with DeepSpeed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch

from infinity.store import Tier
from infinity.zero import FetchUnit, ParamSlot

if TYPE_CHECKING:
    from infinity.engine._engine import Engine

# id(parameter) -> (the parameter, its engine), both weakly (tensors compare by value, so they
# cannot be weak keys); an entry whose parameter is gone is stale.
_HOLDER: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[Engine]]] = {}


def track(engine: Engine) -> None:
    """Remember that `engine` holds its units' parameters."""
    for key in [k for k, (p, e) in _HOLDER.items() if p() is None or e() is None]:
        del _HOLDER[key]
    for unit in engine.units:
        for slot in unit.slots:
            _HOLDER[id(slot.param)] = (weakref.ref(slot.param), weakref.ref(engine))


def holder(param: torch.Tensor) -> Engine | None:
    """The engine whose store holds `param`'s values (None: an ordinary parameter)."""
    param_ref, engine_ref = _HOLDER.get(id(param), (None, None))
    if param_ref is None or param_ref() is not param:
        return None
    return engine_ref()


@contextlib.contextmanager
def gathered(
    params: torch.Tensor | Iterable[torch.Tensor], modifier_rank: int | None = None
) -> Iterator[None]:
    """Within the block, `params` hold their real values; see the module docstring.

    Parameters no engine holds are left alone (they hold their values already). Raises
    ValueError for parameters of several engines, a parameter still on the meta device (built
    under zero.Init, created by `initialize`), a modifier rank outside the job, and changes to
    bf16/fp16 parameters the optimizer keeps an fp32 master of (the master would be stale)."""
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    for p in params:
        if p.device.type == "meta" and holder(p) is None:
            raise ValueError(
                "GatheredParameters: a parameter is on the meta device (built under zero.Init): "
                "its values are created by initialize; gather it after that"
            )
    engines = {id(e): e for e in map(holder, params) if e is not None}
    if not engines:
        yield
        return
    if len(engines) > 1:
        raise ValueError(
            "GatheredParameters: the parameters belong to several engines; gather each's apart"
        )
    (engine,) = engines.values()
    engine._check_open()
    if modifier_rank is not None and not 0 <= modifier_rank < engine.ranks.world:
        raise ValueError(
            f"GatheredParameters: modifier_rank {modifier_rank} is not a rank of this job "
            f"(world size {engine.ranks.world})"
        )
    wanted = {id(p) for p in params}
    units = [(u, [s for s in u.slots if id(s.param) in wanted]) for u in engine.units]
    units = [(u, slots) for u, slots in units if slots]
    if modifier_rank is not None:
        _refuse_stale_master(units)
    engine.synchronize()
    engine.coordinator.release_all()
    wholes = [_read_whole(engine, unit) for unit, _ in units]  # unit order: the same on every rank
    for (unit, slots), whole in zip(units, wholes):
        for s in slots:
            s.param.data = (
                whole[s.offset : s.offset + s.shape.numel()]
                .view(s.shape)
                .to(engine.device, unit.compute_dtype)
            )
    try:
        yield
        if modifier_rank is not None:
            for (unit, slots), whole in zip(units, wholes):
                _write_back(engine, unit, slots, whole, modifier_rank)
    finally:
        for unit, slots in units:
            placeholder = torch.empty(0, dtype=unit.compute_dtype, device=engine.device)
            for s in slots:
                s.param.data = placeholder


def _refuse_stale_master(units: list[tuple[FetchUnit, list[ParamSlot]]]) -> None:
    low = [
        s.name for u, slots in units if u.requires_grad and u.dtype != torch.float32 for s in slots
    ]
    if low:
        raise ValueError(
            f"GatheredParameters(modifier_rank=...): {low[0]} is stored in {units[0][0].dtype} and "
            "the optimizer keeps an fp32 master of it, which a change here would not reach; "
            "change it before initialize, or train in fp32"
        )


def _read_whole(engine: Engine, unit: FetchUnit) -> torch.Tensor:
    """A copy of the unit's whole values (gathered from the ranks at stage 3)."""
    with engine.store.hold(unit.key, Tier.HOST) as flat:
        whole = engine.ranked.whole_values(flat, unit)
        return whole.clone() if whole is flat else whole


def _write_back(
    engine: Engine, unit: FetchUnit, slots: list[ParamSlot], whole: torch.Tensor, src: int
) -> None:
    """The modifier rank's values of `slots` into the unit's store entry on every rank."""
    for s in slots:
        whole[s.offset : s.offset + s.shape.numel()] = (
            s.param.data.detach().reshape(-1).to("cpu", unit.dtype)
        )
    engine.ranks.broadcast_(whole, f"gathered parameters of {unit.name}", src=src)
    with engine.store.hold(unit.key, Tier.HOST, dirty=True) as flat:
        flat.copy_(engine.ranked.own_values(unit, whole))
