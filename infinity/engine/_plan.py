"""The memory plan: where parameters live and the byte budget of each store tier, decided and
checked at initialize (never mid-step).

[Note: memory plan] Host RAM holds, beside the store's host tier, one gradient per trained
unit (compute dtype: autograd's tensors held, or a flat buffer; infinity/zero/grads.py). The
host tier holds the parameters whose home is the host, else a working set of parameters
(resident units, three of the largest unit, the prefetch bucket) and, with a
`host_memory_budget`, whatever of the budget the plan leaves, up to every parameter and all
the optimizer state on NVMe: a cache, so the units backward takes right after forward used
them, those the next forward meets again, and the state, are not read again (the 294M GPT
with int8 state: 2.15-2.38 GB a step instead of 2.67-2.79 with its parameters cached, 8-21%
off the step at 32 tokens and 3-12% at 128; 1.19 GB instead of 1.82, 20-28% off at 32 tokens,
with its state too; the store slides only the copies one hole needs, [Note: compacting just
enough] in infinity/memory/arena.py, without which such a tier compacted for 0.5 s a step),
plus the Adam state (8 B/element, 12 with the fp32 master of a low-precision unit; fewer in a
compressed `infinity.optimizer_state`: `StateFormat.bytes_per_element`) for
offload_optimizer "cpu" or "none" (the optimizer runs on the CPU either way), else a few
optimizer tiles. NVMe holds parameters and/or optimizer state per the offload devices, with
a little slack (1/64). When `host_memory_budget` cannot hold the gradient buffers beside the
smallest host tier, they go to the store too (at home on NVMe, two of the largest passing
through the host tier): each micro-batch then writes them, later ones of a step and the
optimizer read them (a step's first overwrites them unread). There they are kept in the
dtype of the unit's values, not the compute dtype: bf16 values computed in fp32 (a CPU
without bf16 units) keep bf16 gradients on NVMe, half the bytes on disk and per micro-batch
(a 7 B model: 13.5 GB, not 27), rounded once per micro-batch as bf16 compute would be (sums
over micro-batches are rounded at each add). A speculated step
(`speculates`: the optimizer overlapped, docs/engine.md "The speculative step") keeps
the old state beside the new until the step is validated: room for a second copy of the state
and of the trained values on the state's tier (NVMe: the swap file grows by it; the host: a
budget may cap it, and units without room are then stepped after validation).

[Note: what computing holds outside the store] Modules computing on the host use a unit's
values in the store directly, unless its compute dtype is wider than its values' (bf16
computed in fp32 on a CPU without bf16 units): then through a copy made when it is used,
outside the store: the resident units' and two of the largest in the compute dtype (those
copies are made into buffers kept within that, [Note: reused upcast buffers]; at stage 3 over
ranks each is upcast from a gathered buffer in the values' dtype, counted with the
collectives). Gradients whose home is the store arrive as autograd's, in the compute dtype,
before they are added in: two of the largest, also outside. Without these the budget held the
host tier, not the process: the 7 B Llama, bf16 computed in fp32 with `--host-memory 6G`,
peaked at 9340 MiB of RSS (its head and embedding are 524 MB each in fp32), 7348 MiB with them
counted; the price is a smaller cache (the 294M GPT at a 1 GB budget: 1.11x a step,
docs/performance.md).

[Note: memory plan of a rank] With `world` data-parallel ranks every figure above is one
rank's: from stage 1 the Adam state counts only this rank's shard of each unit (1/world of
it, padded), from stage 2 the gradient buffers too, and at stage 3 the parameters the store
holds. Collectives need whole-unit buffers outside the store, counted beside the gradient
buffers: at stage 3 the gathered units in use (resident units, two of the largest, in the
values' dtype), from stage 2 one gradient being reduce-scattered, at stages 1-2 one unit being
gathered after the step.

[Note: fitting the budget] `sub_group_size` (the optimizer tile) and the gradients' home are
the plan's to choose within `host_memory_budget`: it takes the first that fits of the
configured tiles with the gradients in RAM, the largest smaller tiles that fit (down to 2**18
elements) with them in RAM, then both again with the gradients on NVMe, and logs what it chose.
Smaller tiles cost only smaller reads; gradients on NVMe cost a write per micro-batch and
reads, so they come last. When nothing fits, the BudgetError names the smallest budget
that does (`MemoryPlan.min_host_budget`: the smallest tiles, the cheaper gradient home).

When the modules compute from the host tier, a prefetched unit holds its block until it is
used, so the prefetch window is what the host tier holds beyond its smallest working set
(`MemoryPlan.prefetch_numel`, never more than the config asks): a window larger than that would
fill the tier with read-ahead and leave no room for a gradient or an optimizer tile mid-step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from infinity.errors import BudgetError
from infinity.optim import StateFormat
from infinity.store import Tier
from infinity.zero import FetchUnit, Partition, Ranks

logger = logging.getLogger(__name__)

_PAGE = 4096
_TILE_SLACK = 64 << 10  # per optimizer tile: alignment and row padding
_MIN_TILE_NUMEL = 1 << 18  # the smallest optimizer tile the plan picks (3 MiB with a master row)
_TILE_ALIGN = 4096  # elements: a tile size the plan picks is a multiple of it
# The swap file beyond what the plan counts (already page-aligned): its extents are taken once
# (values at placement, state at its first step, gradients at initialize) and rewritten in
# place, so it does not fragment; an eighth was 5 GB of a 7 B model's 46 GB file, unused.
_NVME_SLACK = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _PAGE) * _PAGE


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

    def grad_nbytes(self, unit: FetchUnit, *, stored: bool = False) -> int:
        """A gradient buffer's bytes: in RAM in the compute dtype, in the store (`stored`) in
        the values' dtype."""
        dtype = unit.dtype if stored else unit.compute_dtype
        return self._numel(unit, self.partition.grads) * dtype.itemsize

    @property
    def gathers(self) -> bool:
        """Units are gathered from the ranks' shards to compute (stage 3 over ranks)."""
        return self.partition.ranks.world > 1 and self.partition.stage == 3

    def collective_nbytes(self, units: Sequence[FetchUnit]) -> int:
        """Whole-unit buffers the collectives need outside the store."""
        if self.partition.ranks.world == 1 or not units:
            return 0
        stage = self.partition.stage
        nbytes = 0
        if self.gathers:  # in the values' dtype: a widened unit is upcast from it
            nbytes += _in_use(units, stored=True)
        largest = max(u.compute_nbytes for u in units)
        if stage >= 2:
            nbytes += largest
        if stage in (1, 2):
            nbytes += 2 * largest
        return nbytes

    def computing_nbytes(self, units: Sequence[FetchUnit], *, on_host: bool) -> tuple[int, int]:
        """Host bytes computing holds outside the store, (copies, arriving); see [Note: what
        computing holds outside the store]."""
        if not on_host:
            return 0, 0
        copies = _in_use([u for u in units if u.widened])
        arriving = 2 * max((u.compute_nbytes for u in units if u.requires_grad), default=0)
        return copies, arriving


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    fetch_tier: Tier  # where modules compute from
    param_home: Tier  # where unit values live between uses
    state_tier: Tier  # where the optimizer state lives in the store
    budgets: dict[Tier, int]  # store budget per tier, bytes
    # gradient buffers in RAM (or those arriving), whole-unit buffers of collectives, and the
    # copies of units computed wider than stored
    outside_store_nbytes: int
    grads_tier: Tier | None = None  # home of the gradient buffers in the store (None: in RAM)
    prefetch_numel: int = 0  # elements the coordinator may prefetch (the config's, or less)
    min_host_budget: int = 0  # the smallest host_memory_budget this model and offload accept
    tile_numel: int = 1 << 30  # elements per optimizer tile (sub_group_size with state on NVMe)
    # Of budgets[NVME], the room for a speculated step's kept copy: a disk without it still
    # trains (units without room are stepped after validation); see fit_nvme_budget
    nvme_kept_nbytes: int = 0

    @property
    def uses_nvme(self) -> bool:
        """Parameters or optimizer state (and so possibly gradients) live on NVMe."""
        return Tier.NVME in (self.param_home, self.state_tier)


def plan_memory(units: Sequence[FetchUnit], *, offload_param: str, offload_optimizer: str,
                accelerator: bool, prefetch_numel: int, tile_numel: int,
                host_memory_budget: int | None, world: int = 1, stage: int = 0,
                state_format: StateFormat | None = None, speculates: bool = False) -> MemoryPlan:
    """Budgets for the store from the unit sizes and the offload devices; see [Note: memory plan].
    `host_memory_budget` caps the host tier (less what lives outside the store); the tier is
    never larger than the plan needs. With `world` ranks at ZeRO `stage`, the plan of one rank
    (see [Note: memory plan of a rank]). `tile_numel` (sub_group_size) is an upper bound: see
    [Note: fitting the budget]. `state_format`: how the optimizer state is stored (default
    fp32 moments and master).

    Raises BudgetError, naming the smallest budget that works, when `host_memory_budget`
    cannot hold the smallest working set.
    """
    fetch_tier = Tier.DEVICE if accelerator else Tier.HOST
    param_home = {"none": fetch_tier, "cpu": Tier.HOST, "nvme": Tier.NVME}[offload_param]
    state_tier = {"none": Tier.HOST, "cpu": Tier.HOST, "nvme": Tier.NVME}[offload_optimizer]
    trained = [u for u in units if u.requires_grad]
    state_format = state_format or StateFormat()
    # Adam state per element: moments, and an fp32 master for 16-bit values unless the format
    # has none (8 and 12 bytes in the default format)
    per_element = {id(u): state_format.bytes_per_element(u.dtype) for u in trained}
    tile_per_element = max(per_element.values(), default=12)
    share = _Share(Partition(Ranks(0, world), stage))  # every rank's shard is as large as rank 0's
    largest_state = max((share.state_numel(u) for u in trained), default=0)
    if state_tier == Tier.HOST:  # tiles bound what one NVMe read holds; in RAM, a unit is one tile
        tile_numel = max(largest_state, 1)
    everything = sum(_aligned(share.values_nbytes(u)) for u in units)
    resident = sum(_aligned(share.values_nbytes(u)) for u in units if u.persistent)
    largest = max((_aligned(share.values_nbytes(u)) for u in units if not u.persistent), default=0)
    elt = max((u.nbytes // max(u.numel, 1) for u in units), default=4)
    working = min(everything, resident + 3 * largest + _aligned(prefetch_numel * elt))
    grads = sum(_aligned(share.grad_nbytes(u)) for u in trained)
    stored_grads = sum(_aligned(share.grad_nbytes(u, stored=True)) for u in trained)
    largest_grad = max((_aligned(share.grad_nbytes(u, stored=True)) for u in trained), default=0)
    collectives = share.collective_nbytes(units)
    copies, arriving = share.computing_nbytes(units, on_host=fetch_tier == Tier.HOST)
    has_nvme = Tier.NVME in (param_home, state_tier)  # a swap file to put gradients in

    def state_nbytes(tiles: int) -> int:
        return sum(math.ceil(n * per_element[id(u)]) + _TILE_SLACK * -(-n // tiles)
                   for u, n in ((u, share.state_numel(u)) for u in trained))

    def tile_nbytes(tiles: int) -> int:
        return math.ceil(min(tiles, largest_state) * tile_per_element) + _TILE_SLACK

    # Host-homed values sit in the host tier whole; NVMe-homed ones pass through a working set;
    # device-homed ones only visit the host while the optimizer updates them.
    host_params = {Tier.HOST: everything, Tier.NVME: working, Tier.DEVICE: 2 * largest}[param_home]
    params_minimum = resident + 2 * largest if param_home == Tier.NVME else host_params

    def host_minimum(tiles: int, grads_on_nvme: bool) -> int:
        """The smallest host tier: parameters, optimizer state or tiles, gradients passing."""
        state = state_nbytes(tiles) if state_tier == Tier.HOST else 3 * tile_nbytes(tiles) + largest
        return params_minimum + state + (2 * largest_grad if grads_on_nvme else 0)

    def needs(tiles: int, grads_on_nvme: bool) -> int:
        """The smallest host_memory_budget for this choice: the host tier plus what is outside."""
        return (host_minimum(tiles, grads_on_nvme) + collectives + copies
                + (arriving if grads_on_nvme else grads))

    gradient_homes = [False, True] if grads and has_nvme else [False]
    smallest_tiles = min(tile_numel, _MIN_TILE_NUMEL) if state_tier == Tier.NVME else tile_numel
    min_budget = min(needs(smallest_tiles, g) for g in gradient_homes)
    chosen = (tile_numel, False)
    if host_memory_budget is not None:
        budget = int(host_memory_budget)
        candidates = [(t, g) for g in gradient_homes for t in (
            tile_numel, _fitting_tiles(budget, needs, g, smallest_tiles, tile_numel,
                                       3 * tile_per_element)
            if state_tier == Tier.NVME else None)]
        chosen = next(((t, g) for t, g in candidates
                       if t is not None and needs(t, g) <= budget), None)
        if chosen is None:
            raise BudgetError(_refusal(
                budget, min_budget, state_tier == Tier.NVME and tile_numel, smallest_tiles,
                largest, offloaded=param_home == state_tier == Tier.NVME))
        if chosen != (tile_numel, False):
            _log_choice(budget, tile_numel, *chosen)
    tile_numel, grads_on_nvme = chosen
    budgets: dict[Tier, int] = {}
    if accelerator:
        budgets[Tier.DEVICE] = everything if param_home == Tier.DEVICE else working
    state = state_nbytes(tile_numel)
    kept = state + sum(_aligned(share.values_nbytes(u)) for u in trained) if speculates else 0
    host_state = state + kept if state_tier == Tier.HOST else 4 * tile_nbytes(tile_numel) + largest
    host = host_params + host_state + (2 * largest_grad if grads_on_nvme else 0)
    outside = collectives + copies + (arriving if grads_on_nvme else grads)
    if host_memory_budget is not None:
        host = min(host, int(host_memory_budget) - outside)
        # the rest of the budget caches what lives on NVMe: parameters, then optimizer state
        cacheable = (everything - host_params if param_home == Tier.NVME else 0) + \
            (max(0, state - host_state) if state_tier == Tier.NVME else 0)
        host += max(0, min(cacheable, int(host_memory_budget) - outside - host))
    budgets[Tier.HOST] = host
    if fetch_tier == Tier.HOST:  # read-ahead takes only what the smallest working set leaves
        spare = host - host_minimum(tile_numel, grads_on_nvme)
        prefetch_numel = min(prefetch_numel, max(0, spare) // elt)
    nvme_kept = kept if state_tier == Tier.NVME else 0
    nvme = (everything if param_home == Tier.NVME else 0) + \
        (state + nvme_kept if state_tier == Tier.NVME else 0)
    if grads_on_nvme:
        nvme += stored_grads
    if nvme:
        budgets[Tier.NVME] = nvme + nvme // _NVME_SLACK + (16 << 20)
    return MemoryPlan(fetch_tier, param_home, state_tier, budgets, outside,
                      Tier.NVME if grads_on_nvme else None, prefetch_numel, min_budget, tile_numel,
                      nvme_kept)


def _in_use(units: Sequence[FetchUnit], *, stored: bool = False) -> int:
    """Whole units in the compute dtype (`stored`: the values' dtype) while modules use them:
    the resident ones and two of the largest (the one in use and the next)."""
    def nbytes(u: FetchUnit) -> int:
        return u.nbytes if stored else u.compute_nbytes

    return (sum(nbytes(u) for u in units if u.persistent)
            + 2 * max((nbytes(u) for u in units if not u.persistent), default=0))


def _fitting_tiles(budget: int, needs: Callable[[int, bool], int], grads_on_nvme: bool,
                   smallest: int, most: int, per_element: float) -> int | None:
    """The largest tile (elements, a multiple of _TILE_ALIGN unless that is below `smallest`)
    between `smallest` and `most` whose plan fits `budget`; None when not even `smallest` does.
    The plan's bytes grow by `per_element` per tile element (three tiles: 36 bytes of master
    and two moments in the default format)."""
    fixed = needs(0, grads_on_nvme)
    fitting = min(most, int((budget - fixed) / per_element) // _TILE_ALIGN * _TILE_ALIGN)
    return max(fitting, smallest) if needs(smallest, grads_on_nvme) <= budget else None


def _refusal(budget: int, min_budget: int, tiles_from: int | bool, smallest_tiles: int,
             largest: int, *, offloaded: bool) -> str:
    """The BudgetError's text: the budget, the least that works, and what sets it."""
    tiles = f", optimizer tiles as small as {smallest_tiles} elements (zero_optimization." \
            f"sub_group_size {tiles_from} is the most)" if tiles_from else ""
    more = "" if offloaded else " or offload more (offload_param/offload_optimizer device 'nvme')"
    least = f"{min_budget / 1e9:.3g} GB" if min_budget >= 1e8 else f"{min_budget / 1e6:.3g} MB"
    return (f"host_memory_budget {budget} bytes cannot hold this model's plan: it needs at least "
            f"{min_budget} bytes ({least}), with the largest unit {largest} bytes{tiles}; set "
            f"infinity.host_memory_budget to at least {min_budget}{more}")


def _log_choice(budget: int, asked_tiles: int, tiles: int, grads_on_nvme: bool) -> None:
    chose = [] if tiles == asked_tiles else \
        [f"optimizer tiles of {tiles} elements (sub_group_size {asked_tiles} is the most)"]
    if grads_on_nvme:
        chose.append("the gradients on NVMe (written every micro-batch, read to add to and step)")
    logger.info("memory plan: host_memory_budget %d bytes fits with %s", budget,
                " and ".join(chose))


def fit_nvme_budget(budget: int, kept: int, free: int, keep_free: int = 0) -> int:
    """The NVMe budget for a disk with `free` bytes: the plan's `budget` where it fits, else
    less of the speculated step's `kept` room (down to none: every unit is then stepped after
    validation), leaving 1/64 of the disk and `keep_free` bytes free (what the run writes
    beside the swap file); `budget` unchanged when even the rest does not fit (opening the swap
    file then fails, naming the disk)."""
    room = free - free // _NVME_SLACK
    if budget - kept > room:
        return budget
    return max(budget - kept, min(budget, room - keep_free))
