"""What a speculative step keeps of a unit's values until it is validated.

[Note: speculative steps] A caller that steps units before it knows whether the step stands
(the engine during backward, before the global norm and finiteness are known: issue 22) steps
them speculatively: `step_unit(u, ..., speculative=True)`, then `commit_unit(u)` or
`rollback_unit(u)`. Until then the optimizer keeps what the step overwrote. A tile's new state
goes to a fresh store entry and its old entry stays (`TileSet.updating(..., aside=True)`; on
NVMe the new state is written to fresh extents, the old ones are not touched). The unit's
values entry belongs to the engine (its key is what the engine fetches), so it is updated in
place as always and a copy of the old values is put aside first, in the state's tier
(`KeptValues`). A commit drops the old entries (no I/O); a rollback drops the new tile entries,
makes the old ones current again with the steps they held, and copies the old values back; a
step of the same number then updates the unit again from exactly the state it started from.
Where the store has no room for what a speculation keeps (BudgetError), the unit is rolled back
at once and `step_unit` returns False: the caller steps it once the step is validated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infinity.optim._tiles import UnitSpec
from infinity.store import TensorStore, Tier


class KeptValues:
    """Copies of units' values (the elements each unit steps) taken before a speculative step
    changed them, each a store entry at home on `tier` until committed or rolled back."""

    def __init__(self, store: TensorStore, units: Sequence[UnitSpec], name: str,
                 tier: Tier) -> None:
        self._store, self._units, self._name, self._tier = store, units, name, tier

    def _key(self, u: int) -> str:
        return f"{self._name}/kept-values{u}"

    def keep(self, u: int, values: torch.Tensor) -> None:
        """Put unit u's values aside unless they are already (a retried pass: what was kept
        first is the state before the step)."""
        if self._key(u) not in self._store:
            self._store.put(self._key(u), values, self._tier)

    def commit(self, u: int) -> None:
        if self._key(u) in self._store:
            self._store.drop(self._key(u))

    def roll_back(self, u: int) -> None:
        """Copy unit u's kept values back into its values entry (written back dirty)."""
        key = self._key(u)
        if key not in self._store:
            return
        spec = self._units[u]
        with self._store.hold(key, Tier.HOST) as kept, \
                self._store.hold(spec.values_key, Tier.HOST, dirty=True) as values:
            values.view(-1)[spec.offset:spec.offset + spec.numel].copy_(kept)
        self._store.drop(key)
