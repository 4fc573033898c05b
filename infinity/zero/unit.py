"""FetchUnit: the parameters of one module, flattened into one 1-D store entry (FSDP's
FlatParameter), and how a model is cut into units.

Each unit holds parameters of one dtype and one requires_grad, so a unit is also the unit of the
optimizer (a frozen parameter never shares a flat gradient with a trained one). A unit may be
stored in a narrower dtype than it computes in (bf16 storage, fp32 compute on CPUs without bf16
units): it is upcast when fetched, and its gradients are kept in the compute dtype. Parameters at or
below the persistence threshold are gathered into "resident" units (one per dtype and
requires_grad) that stay fetched from their first use to the optimizer step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from infinity.store import TensorFuture, TensorStore, Tier
from infinity.zero._common import UnitState
from infinity.zero.grads import GradBuffer, HeldGrad
from infinity.zero.ranks import Partition

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ParamSlot:
    """Where one parameter lives inside its unit's flat tensor."""

    param: torch.nn.Parameter
    name: str  # qualified name in the model, for messages
    offset: int  # first element in the flat tensor
    shape: torch.Size


@dataclass(slots=True, eq=False)
class FetchUnit:
    """One store entry of flattened parameters, fetched and released as a whole.

    The store entry (`key`) holds the values; between uses each parameter's `.data` is an empty
    placeholder. `grad` is the unit's flat gradient buffer (accumulated across micro-batches), in
    RAM unless the engine put it in the store.
    """

    index: int
    key: str  # store key of the 1-D values entry
    name: str  # module that owns the parameters ("<resident>" for persistent ones)
    slots: list[ParamSlot]
    numel: int
    dtype: torch.dtype  # of the values in the store
    requires_grad: bool
    persistent: bool
    compute_dtype: torch.dtype  # of the parameters while fetched, and of the gradients
    # - Lifecycle (see UnitState)
    state: UnitState = UnitState.RELEASED
    users: int = 0  # module uses in progress (forward calls, one backward hold)
    future: TensorFuture | None = None  # set while FETCHING or READY
    flat: torch.Tensor | None = None  # 1D, set while READY
    # - Backward bookkeeping, reset by every backward
    held_for_backward: bool = False
    grads_seen: int = 0  # params whose grad became final in this backward
    # - Gradient accumulated over the micro-batches of one step, compute dtype
    grad: GradBuffer | None = None
    last_pos: int = field(default=-1)  # trace position of the latest use in this pass

    @property
    def nbytes(self) -> int:
        """Bytes of the values in the store."""
        return self.numel * self.dtype.itemsize

    @property
    def widened(self) -> bool:
        """Whether the unit computes in a wider dtype than it is stored in (used through an
        upcast copy)."""
        return self.compute_dtype.itemsize > self.dtype.itemsize

    @property
    def compute_nbytes(self) -> int:
        """Bytes of the values while fetched (the compute dtype), and of a whole gradient."""
        return self.numel * self.compute_dtype.itemsize


    def expect(self, *states: UnitState) -> None:
        """Raise if the unit is not in one of `states` (a wrong transition is a bug, say which)."""
        if self.state not in states:
            raise RuntimeError(f"unit {self.name!r} is {self.state.value}, expected "
                               f"{' or '.join(s.value for s in states)}")

    def bind(self, flat: torch.Tensor) -> None:
        """Point every parameter at its view of the fetched flat tensor (upcast first when the
        unit computes in a wider dtype than it is stored in)."""
        if flat.dtype != self.compute_dtype:
            flat = flat.to(self.compute_dtype)
        self.flat = flat
        for s in self.slots:
            s.param.data = flat[s.offset:s.offset + s.shape.numel()].view(s.shape)

    def unbind(self, placeholder: torch.Tensor) -> None:
        """Give every parameter the empty placeholder; the flat tensor is no longer referenced."""
        self.flat = None
        for s in self.slots:
            s.param.data = placeholder

    def take_grads(self) -> None:
        """Take the parameters' gradients into the unit's gradient (by default the tensors
        themselves, see HeldGrad) and set their `.grad` to None."""
        if self.grad is None:
            self.grad = HeldGrad([s.shape.numel() for s in self.slots], self.compute_dtype,
                                 name=self.key)
        self.grad.accumulate(self.slots)


def _groups(params: list[tuple[str, torch.nn.Parameter]]) -> dict[tuple[torch.dtype, bool], list]:
    groups: dict[tuple[torch.dtype, bool], list] = {}
    for name, p in params:
        groups.setdefault((p.dtype, p.requires_grad), []).append((name, p))
    return groups


def _suffix(dtype: torch.dtype, requires_grad: bool, several: bool) -> str:
    return (f"[{str(dtype).removeprefix('torch.')},{'train' if requires_grad else 'frozen'}]"
            if several else "")


def plan_units(model: torch.nn.Module, *, persistence_numel: int,
               storage_dtype: torch.dtype | None = None, prefix: str = "param",
               meta_ok: bool = False, resident_modules: bool = False,
               ) -> tuple[list[FetchUnit], dict[torch.nn.Module, list[FetchUnit]]]:
    """Cut `model` into fetch units (nothing is moved yet; see `place_units`).

    With `meta_ok`, parameters may be on the meta device (their values are put into the store
    by the caller, e.g. streamed from a checkpoint, instead of by `place_units`).
    With `storage_dtype`, floating-point units are stored in it and computed in the model's
    dtype (bf16 storage, fp32 compute).
    A parameter belongs to the first module (in `named_modules` order) that holds it directly,
    so tied and shared parameters are one unit; every module holding it maps to that unit.
    Parameters of at most `persistence_numel` elements go to resident units; with
    `resident_modules` every module's unit is resident too (same cut, no fetch per use).
    Returns (units, module -> non-resident units it uses directly).
    """
    owner: dict[int, FetchUnit | None] = {}
    per_module: dict[torch.nn.Module, list[tuple[str, torch.nn.Parameter]]] = {}
    resident: list[tuple[str, torch.nn.Parameter]] = []
    for mname, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in owner:
                continue
            qualified = f"{mname}.{pname}" if mname else pname
            if p.device.type == "meta" and not meta_ok:
                raise ValueError(f"parameter {qualified!r} is on the meta device; "
                                 "materialise the model first")
            owner[id(p)] = None  # claimed here; its unit is filled in below
            if p.numel() <= persistence_numel:
                resident.append((qualified, p))
            else:
                per_module.setdefault(module, []).append((qualified, p))
    names = {m: n for n, m in model.named_modules()}
    batches = [(names[m] or "<root>", params, resident_modules) for m, params in per_module.items()]
    batches.append(("<resident>", resident, True))
    units: list[FetchUnit] = []
    for name, params, persistent in batches:
        groups = _groups(params)
        for (dtype, requires_grad), members in groups.items():
            # the resident unit's key names its kind
            suffixed = len(groups) > 1 or params is resident
            key = f"{prefix}/{name}{_suffix(dtype, requires_grad, suffixed)}"
            slots, offset = [], 0
            for qualified, p in members:
                slots.append(ParamSlot(p, qualified, offset, p.shape))
                offset += p.numel()
            stored = (storage_dtype if storage_dtype is not None and dtype.is_floating_point
                      else dtype)
            units.append(FetchUnit(len(units), key, name, slots, offset, stored, requires_grad,
                                   persistent, compute_dtype=dtype))
            for s in slots:
                owner[id(s.param)] = units[-1]
    uses: dict[torch.nn.Module, list[FetchUnit]] = {}
    for module in model.modules():
        mine = []
        for p in module.parameters(recurse=False):
            unit = owner[id(p)]
            if not unit.persistent and unit not in mine:
                mine.append(unit)
        if mine:
            uses[module] = mine
    logger.info("zero: %d fetch units (%d resident) over %d parameters", len(units),
                sum(u.persistent for u in units), len(owner))
    return units, uses


def put_unit(store: TensorStore, unit: FetchUnit, flat: torch.Tensor, home: Tier,
             partition: Partition | None) -> None:
    """Put a unit's flat values into `store` at home on `home`. With several ranks every rank
    starts from rank 0's values (as DDP and DeepSpeed broadcast them), and with the parameters
    partitioned (stage 3) the store holds only this rank's padded shard of them."""
    if partition is not None:
        partition.ranks.broadcast_(flat, f"values {unit.key}")
        if partition.params:
            flat = partition.ranks.shard(unit.numel).padded(flat)
    store.put(unit.key, flat, home)


def place_units(units: list[FetchUnit], store: TensorStore, *, home: Tier, device: torch.device,
                partition: Partition | None = None) -> None:
    """Move each unit's values into `store` (at home on `home`; see `put_unit` for
    `partition`) and leave empty placeholders (on `device`) in the parameters; the original
    tensors are freed unit by unit."""
    placeholders: dict[torch.dtype, torch.Tensor] = {}
    for unit in units:
        store_unit(store, unit, torch.cat([s.param.detach().reshape(-1).to("cpu")
                                           for s in unit.slots]).to(unit.dtype),
                   home, partition, placeholders, device)


def store_unit(store: TensorStore, unit: FetchUnit, flat: torch.Tensor, home: Tier,
               partition: Partition | None, placeholders: dict[torch.dtype, torch.Tensor],
               device: torch.device) -> None:
    """Put a unit's flat values into `store` (`put_unit`) and leave in its parameters the empty
    placeholder of its compute dtype on `device` (one per dtype, kept in `placeholders`), so
    the caller that hands `flat` over holds none of the unit's values afterwards."""
    put_unit(store, unit, flat, home, partition)
    del flat
    if unit.compute_dtype not in placeholders:
        placeholders[unit.compute_dtype] = torch.empty(0, dtype=unit.compute_dtype,
                                                       device=device)
    unit.unbind(placeholders[unit.compute_dtype])
