"""The memory plan: where parameters live and the byte budget of each store tier, decided and
checked at initialize (never mid-step).

[Note: memory plan] Host RAM holds, beside the store's host tier, one gradient per trained
unit (compute dtype: autograd's tensors held, or a flat buffer; infinity/zero/grads.py). The host tier holds the parameters whose home is the host, else a
working set of parameters (resident units, three of the largest unit, the prefetch bucket),
plus the Adam state (8 B/element, 12 with the fp32 master of a low-precision unit) for
offload_optimizer "cpu" or "none" (the optimizer runs on the CPU either way), else a few
optimizer tiles. NVMe holds parameters and/or optimizer state per the offload devices, with
slack for alignment. When `host_memory_budget` cannot hold the gradient buffers beside the
smallest host tier, they go to the store too (at home on NVMe, two of the largest passing
through the host tier): each micro-batch then reads and writes them.

[Note: memory plan of a rank] With `world` data-parallel ranks every figure above is one
rank's: from stage 1 the Adam state counts only this rank's shard of each unit (1/world of
it, padded), from stage 2 the gradient buffers too, and at stage 3 the parameters the store
holds. Collectives need whole-unit buffers outside the store, counted beside the gradient
buffers: at stage 3 the gathered units in use (resident units, two of the largest), from stage
2 one gradient being reduce-scattered, at stages 1-2 one unit being gathered after the step.

When the modules compute from the host tier, a prefetched unit holds its block until it is
used, so the prefetch window is what the host tier holds beyond its smallest working set
(`MemoryPlan.prefetch_numel`, never more than the config asks): a window larger than that would
fill the tier with read-ahead and leave no room for a gradient or an optimizer tile mid-step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infinity.errors import BudgetError
from infinity.store import Tier
from infinity.zero import FetchUnit, Partition, Ranks

_PAGE = 4096
_TILE_SLACK = 64 << 10  # per optimizer tile: alignment and row padding


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


def _state_nbytes(unit: FetchUnit, numel: int) -> int:
    """Adam state of `numel` elements of a unit: moments, plus an fp32 master for low-precision
    values."""
    return numel * (8 if unit.dtype == torch.float32 else 12)


@dataclass(frozen=True, slots=True)
class _Share:
    """Bytes of a unit one rank keeps, per kind, by the partition's rules (what each ZeRO stage
    partitions, and the shard sizes); see [Note: memory plan of a rank]."""

    partition: Partition

    def _numel(self, unit: FetchUnit, partitioned: bool) -> int:
        return self.partition.ranks.shard(unit.numel).numel if partitioned else unit.numel

    def values_nbytes(self, unit: FetchUnit) -> int:
        return self._numel(unit, self.partition.params) * unit.dtype.itemsize

    def state_numel(self, unit: FetchUnit) -> int:
        return self._numel(unit, self.partition.state)

    def grad_nbytes(self, unit: FetchUnit) -> int:
        return self._numel(unit, self.partition.grads) * unit.compute_dtype.itemsize

    def collective_nbytes(self, units: Sequence[FetchUnit]) -> int:
        """Whole-unit buffers the collectives need outside the store."""
        if self.partition.ranks.world == 1 or not units:
            return 0
        stage = self.partition.stage
        largest = max(u.numel * u.compute_dtype.itemsize for u in units)
        nbytes = 0
        if stage == 3:
            nbytes += sum(u.numel * u.compute_dtype.itemsize for u in units if u.persistent) + 2 * largest
        if stage >= 2:
            nbytes += largest
        if stage in (1, 2):
            nbytes += 2 * largest
        return nbytes


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    fetch_tier: Tier  # where modules compute from
    param_home: Tier  # where unit values live between uses
    state_tier: Tier  # where the optimizer state lives in the store
    budgets: dict[Tier, int]  # store budget per tier, bytes
    outside_store_nbytes: int  # gradient buffers in RAM, and whole-unit buffers of collectives
    grads_tier: Tier | None = None  # home of the gradient buffers in the store (None: in RAM)
    prefetch_numel: int = 0  # elements the coordinator may prefetch (the config's, or less)
    min_host_budget: int = 0  # the smallest host_memory_budget this model and offload accept
    tile_numel: int = 1 << 30  # elements per optimizer tile (sub_group_size with state on NVMe)

    @property
    def uses_nvme(self) -> bool:
        """Parameters or optimizer state (and so possibly gradients) live on NVMe."""
        return Tier.NVME in (self.param_home, self.state_tier)


def plan_memory(units: Sequence[FetchUnit], *, offload_param: str, offload_optimizer: str,
                accelerator: bool, prefetch_numel: int, tile_numel: int,
                host_memory_budget: int | None, world: int = 1, stage: int = 0) -> MemoryPlan:
    """Budgets for the store from the unit sizes and the offload devices; see [Note: memory plan].
    `host_memory_budget` caps the host tier (less what lives outside the store); the tier is
    never larger than the plan needs. With `world` ranks at ZeRO `stage`, the plan of one rank
    (see [Note: memory plan of a rank]).

    Raises BudgetError when `host_memory_budget` cannot hold the smallest working set.
    """
    fetch_tier = Tier.DEVICE if accelerator else Tier.HOST
    param_home = {"none": fetch_tier, "cpu": Tier.HOST, "nvme": Tier.NVME}[offload_param]
    state_tier = {"none": Tier.HOST, "cpu": Tier.HOST, "nvme": Tier.NVME}[offload_optimizer]
    trained = [u for u in units if u.requires_grad]
    share = _Share(Partition(Ranks(0, world), stage))  # every rank's shard is as large as rank 0's
    if state_tier == Tier.HOST:  # tiles bound what one NVMe read holds; in RAM, a unit is one tile
        tile_numel = max((share.state_numel(u) for u in trained), default=1)
    everything = sum(_aligned(share.values_nbytes(u)) for u in units)
    resident = sum(_aligned(share.values_nbytes(u)) for u in units if u.persistent)
    largest = max((_aligned(share.values_nbytes(u)) for u in units if not u.persistent), default=0)
    elt = max((u.nbytes // max(u.numel, 1) for u in units), default=4)
    working = min(everything, resident + 3 * largest + _aligned(prefetch_numel * elt))
    tile_elements = min(tile_numel, max((share.state_numel(u) for u in trained), default=0))
    tile = tile_elements * 12 + _TILE_SLACK
    state = sum(_state_nbytes(u, share.state_numel(u)) + _TILE_SLACK * -(-share.state_numel(u) // tile_numel)
                for u in trained)
    grads = sum(_aligned(share.grad_nbytes(u)) for u in trained)
    collectives = share.collective_nbytes(units)
    outside = grads + collectives

    budgets: dict[Tier, int] = {}
    if accelerator:
        budgets[Tier.DEVICE] = everything if param_home == Tier.DEVICE else working
    # Host-homed values sit in the host tier whole; NVMe-homed ones pass through a working set;
    # device-homed ones only visit the host while the optimizer updates them.
    host_params = {Tier.HOST: everything, Tier.NVME: working, Tier.DEVICE: 2 * largest}[param_home]
    host_state = {Tier.HOST: state, Tier.NVME: 4 * tile + largest}[state_tier]
    host_minimum = (resident + 2 * largest if param_home == Tier.NVME else host_params) + \
        {Tier.HOST: state, Tier.NVME: 3 * tile + largest}[state_tier]
    host = host_params + host_state
    grads_tier = None
    has_nvme = Tier.NVME in (param_home, state_tier)  # a swap file to put gradients in
    largest_grad = max((_aligned(share.grad_nbytes(u)) for u in trained), default=0)
    min_budget = host_minimum + collectives + (min(grads, 2 * largest_grad) if has_nvme else grads)
    if host_memory_budget is not None:
        budget = int(host_memory_budget)
        if budget - outside < host_minimum and grads and has_nvme:  # gradients must leave RAM
            grads_tier, outside = Tier.NVME, collectives
            host_minimum += 2 * largest_grad
            host += 2 * largest_grad
        if budget - outside < host_minimum:
            tiles = f"{3 * tile} in 3 optimizer tiles of {tile_elements} elements " \
                f"(zero_optimization.sub_group_size {tile_numel}: lower it for smaller tiles); " \
                if state_tier == Tier.NVME else ""
            raise BudgetError(
                f"host_memory_budget {budget} bytes cannot hold this model's plan: {outside} "
                f"bytes of gradients{' and collective buffers' if collectives else ''} in RAM plus at least "
                f"{host_minimum} bytes of parameters, optimizer tiles{' and gradients' if grads_tier else ''} "
                f"in the host tier ({tiles}the largest unit {largest} bytes); raise the budget or offload more "
                f"(offload_param/offload_optimizer device 'nvme')")
        host = min(host, budget - outside)
    budgets[Tier.HOST] = host
    if fetch_tier == Tier.HOST:  # read-ahead takes only what the smallest working set leaves
        prefetch_numel = min(prefetch_numel, max(0, host - host_minimum) // elt)
    nvme = (everything if param_home == Tier.NVME else 0) + (state if state_tier == Tier.NVME else 0)
    if grads_tier is not None:
        nvme += grads
    if nvme:
        budgets[Tier.NVME] = nvme + nvme // 8 + (16 << 20)
    return MemoryPlan(fetch_tier, param_home, state_tier, budgets, outside, grads_tier, prefetch_numel,
                      min_budget, tile_numel)
