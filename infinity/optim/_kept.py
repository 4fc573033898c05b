"""What a speculative step keeps of a unit's values until it is validated.

[Note: speculative steps] A caller that steps units before it knows whether the step stands
(the engine during backward, before the global norm and finiteness are known: issue 22) steps
them speculatively: `step_unit(u, ..., speculative=True)`, then `commit_unit(u)` or
`rollback_unit(u)`. Until then the store keeps what the step overwrites ([Note: kept versions]
in infinity/store/_kept.py): each tile's bytes (`TileSet.keep`), and the
unit's values entry. On NVMe that is copy-on-write: the old extents stay as they were and the
new state and values are written back to fresh ones, asynchronously, as an unkept step's are;
no byte is copied. In RAM the store copies the block. The values entry belongs to the engine
(its key is what the engine fetches) and is updated in place as always; the store keeps it
where it is at home on the state's tier (where the memory plan reserves the kept room) and the
unit is its only one; otherwise a copy of the elements the unit steps is put aside on the
state's tier (`KeptValues`). A commit lets the kept bytes go (no I/O); a rollback makes them
the tiles' and values' bytes again, with the steps the tiles held; a step of the same number
then updates the unit again from exactly the state it started from. Where the store has no
room for what a speculation keeps (BudgetError), the unit is rolled back at once and
`step_unit` returns False: the caller steps it once the step is validated. It is kept before
anything of the unit is read (`keep_unit`, which a caller may call first, before reading the
gradient): where its values are kept in the store, a unit without room costs no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from infinity.optim._tiles import UnitSpec
from infinity.store import TensorStore, Tier


class KeptValues:
    """Units' values as they were before a speculative step changed them, until committed or
    rolled back: kept by the store where the values entry is at home on `tier` and stepped by
    that unit alone, else a copy of the elements the unit steps put at home on `tier`."""

    def __init__(self, store: TensorStore, units: Sequence[UnitSpec], name: str,
                 tier: Tier) -> None:
        self._store, self._units, self._name, self._tier = store, units, name, tier
        users = Counter(spec.values_key for spec in units)
        self._shared = {key for key, n in users.items() if n > 1}
        self._in_store: dict[int, bool] = {}  # unit -> kept by the store (else a copy aside)

    def _key(self, u: int) -> str:
        return f"{self._name}/kept-values{u}"

    def keep(self, u: int, values: Callable[[], torch.Tensor]) -> None:
        """Keep unit u's values unless they are already (a retried pass: what was kept first
        is the state before the step). `values()` gives the elements it steps, called only
        where a copy is put aside (the store keeps the others without reading them)."""
        if u in self._in_store:
            return
        key = self._units[u].values_key
        if key not in self._shared and self._store.home(key) == self._tier:
            self._store.keep(key)
            self._in_store[u] = True
        else:
            self._store.put(self._key(u), values(), self._tier)
            self._in_store[u] = False

    def commit(self, u: int) -> None:
        in_store = self._in_store.get(u)
        if in_store is not None:
            if in_store:
                self._store.commit(self._units[u].values_key)
            else:
                self._store.drop(self._key(u))
            del self._in_store[u]

    def roll_back(self, u: int) -> None:
        """Unit u's values as they were kept (a copy aside is copied back, written back
        dirty)."""
        in_store = self._in_store.get(u)
        if in_store is None:
            return
        spec = self._units[u]
        if in_store:
            self._store.rollback(spec.values_key)
        else:
            with self._store.hold(self._key(u), Tier.HOST) as kept, \
                    self._store.hold(spec.values_key, Tier.HOST, dirty=True) as values:
                values.view(-1)[spec.offset:spec.offset + spec.numel].copy_(kept)
            self._store.drop(self._key(u))
        del self._in_store[u]
