"""The engine's per-unit work split over data-parallel ranks by the ZeRO stage (docs/scale.md,
"Ranks"); with one rank every answer is "the whole unit" and no collective is issued.

| stage | store holds (values)   | gradient buffer                   | optimizer steps        |
|-------|------------------------|-----------------------------------|------------------------|
| 0     | whole unit             | whole, averaged once per step     | whole unit             |
| 1     | whole unit             | whole, averaged once per step     | own shard, then gather |
| 2     | whole unit             | own shard, reduce-scattered       | own shard, then gather |
| 3     | own shard (padded)     | own shard, reduce-scattered       | own shard in place     |

"Averaged once per step": an all-reduce at the accumulation boundary, as soon as the unit's
gradient is final in the last backward (or at the step for a unit that got none), so the
overlapped optimizer still starts early. "Then gather": after every unit is stepped, each
rank's updated shard is all-gathered into every rank's values. The gradient norm for clipping
and the fp16 overflow check is the sum of squares over the shards, all-reduced, so every rank
decides the same. See [Note: shards of a unit] and [Note: collective order] in
infinity.zero.ranks.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from infinity.optim import UnitSpec
from infinity.store import TensorStore, Tier
from infinity.zero import FetchUnit, GradBuffer, Partition, RamGrad, StoredGrad


class RankedUnits:
    """What this rank does with each trained unit (`trained[i]`, `index[unit]` is i) under
    `partition`. `optimizer_specs` (trained unit i -> what this rank's optimizer steps of it)
    and `optimizer_index` (i -> the optimizer's unit) lack the units this rank steps no
    element of."""

    def __init__(self, partition: Partition, trained: list[FetchUnit]) -> None:
        self.partition = partition
        self.ranks = partition.ranks
        self.trained = trained
        self.index = {u: i for i, u in enumerate(trained)}
        self.optimizer_specs = self._optimizer_specs()
        self.optimizer_index = {i: j for j, i in enumerate(self.optimizer_specs)}
        self._averaged: set[int] = set()  # units whose gradient was averaged this step

    def _optimizer_specs(self) -> dict[int, UnitSpec]:
        """A unit whose shard is all padding is absent at stages 1 and 2."""
        specs = {}
        for i, u in enumerate(self.trained):
            shard = self.ranks.shard(u.numel)
            if self.partition.params:  # the values entry is the padded shard
                specs[i] = UnitSpec(shard.numel, u.dtype, u.key)
            elif self.partition.state:
                if shard.real_numel:
                    specs[i] = UnitSpec(shard.real_numel, u.dtype, u.key, shard.start)
            else:
                specs[i] = UnitSpec(u.numel, u.dtype, u.key)
        return specs

    def grad_part(self, i: int, pieces: list[torch.Tensor]) -> list[torch.Tensor] | torch.Tensor:
        """The part of unit i's gradient (`GradBuffer.read_pieces()`) that its optimizer spec
        steps. With several ranks the buffer is one flat tensor."""
        if self.ranks.world == 1 or self.partition.params:
            return pieces
        grad, = pieces
        shard = self.ranks.shard(self.trained[i].numel)
        if self.partition.grads:
            return grad[:shard.real_numel]
        if self.partition.state:
            return grad[shard.start:shard.stop]
        return grad

    def make_grad(self, unit: FetchUnit, store: TensorStore,
                  grads_tier: Tier | None) -> GradBuffer | None:
        """The unit's gradient buffer (None: the coordinator makes a RAM one when needed)."""
        scatter = self.ranks if self.partition.grads else None
        numel = self.ranks.shard(unit.numel).numel if scatter is not None else unit.numel
        if grads_tier is not None:  # in the values' dtype: see [Note: memory plan]
            return StoredGrad(f"grad/{unit.key}", numel, unit.dtype, store, grads_tier,
                              scatter=scatter, name=unit.key)
        if self.ranks.world > 1:  # made now, so zeros take part in the average too
            return RamGrad(numel, unit.compute_dtype, scatter=scatter, name=unit.key)
        return None

    # -- gradients across ranks ------------------------------------------------------------------

    @property
    def averages(self) -> bool:
        """Whole gradients are averaged over the ranks once per step (stages 0 and 1)."""
        return self.ranks.world > 1 and not self.partition.grads

    def average(self, i: int) -> None:
        """Average unit i's gradient over the ranks if not done this step."""
        if self.averages and i not in self._averaged:
            self.trained[i].grad.average_over(self.ranks)
            self._averaged.add(i)

    def average_rest(self) -> None:
        """At the step: average the units no backward hook averaged (in unit order)."""
        for i in range(len(self.trained)):
            self.average(i)

    def new_step(self) -> None:
        self._averaged.clear()

    def sum_over_shards(self, local: float, what: str) -> float:
        """A figure of this rank's gradients (a sum of squares, a count of non-finite units)
        summed over every rank's shard (stages 2-3); at stages 0-1 each rank holds the whole
        averaged gradient already."""
        if self.partition.grads:
            return self.ranks.all_reduce_sum(local, what)
        return local

    # -- values across ranks ---------------------------------------------------------------------

    def gather_values(self, store: TensorStore) -> None:
        """Stages 1-2, after every unit is stepped: each rank's updated shard of each unit's
        values into every rank's values."""
        if not self.partition.state or self.partition.params:
            return
        for u in self.trained:
            shard = self.ranks.shard(u.numel)
            with store.hold(u.key, Tier.HOST, dirty=True) as flat:
                flat.copy_(self.ranks.all_gather(shard.padded(flat), u.numel, f"values {u.key}"))

    def unit_values(self, store: TensorStore,
                    unit: FetchUnit) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, values) of the unit's parameters, whole (gathered at stage 3 on several
        ranks): views of the store's copy, whose use is held until the iteration ends (clone
        what is kept past it)."""
        with store.hold(unit.key, Tier.HOST) as flat:
            flat = self.whole_values(flat, unit)
            for s in unit.slots:
                yield s.name, flat[s.offset:s.offset + s.shape.numel()].view(s.shape)

    def whole_values(self, shard: torch.Tensor, unit: FetchUnit) -> torch.Tensor:
        """A unit's whole values from what the store holds (stage 3: gathered from the ranks)."""
        if self.partition.params:
            return self.ranks.all_gather(shard, unit.numel, f"values {unit.key}")
        return shard

    # -- checkpoints: whole tensors in the file, this rank's part in memory ----------------------

    def whole_state(self, i: int, local: torch.Tensor | None) -> torch.Tensor:
        """One optimizer row (fp32) of trained unit i over every rank, from this rank's part
        (None: this rank steps no element of the unit)."""
        unit = self.trained[i]
        if not self.partition.state:
            return local
        shard = self.ranks.shard(unit.numel)
        mine = torch.zeros(shard.numel, dtype=torch.float32)
        if local is not None:
            mine[:local.numel()] = local.reshape(-1)
        return self.ranks.all_gather(mine, unit.numel, f"optimizer state of {unit.name}")

    def own_values(self, unit: FetchUnit, whole: torch.Tensor) -> torch.Tensor:
        """What this rank's store entry of `unit` holds of its whole values (stage 3: the
        padded shard)."""
        return self.ranks.shard(unit.numel).padded(whole) if self.partition.params else whole

    def own_state_span(self, i: int) -> tuple[int, int, int]:
        """Where the part of a whole optimizer row of trained unit i that this rank's optimizer
        steps lies (see optimizer_specs): (first element, real elements, elements with the
        zero padding after them)."""
        unit = self.trained[i]
        if not self.partition.state:
            return 0, unit.numel, unit.numel
        shard = self.ranks.shard(unit.numel)
        return (shard.start, shard.real_numel,
                shard.numel if self.partition.params else shard.real_numel)

