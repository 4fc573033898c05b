"""NextUseClock: the one writer of the store's next-use hints for fetch units' values.

The store evicts the copy needed farthest away first; "when" is a distance on its clock, whose
unit is one store fetch (`TensorStore.clock`). Units are needed next by the forward and
backward passes (the coordinator knows when from the trace) and by the optimizer's worker (the
engine knows when from its queue). Both tell this clock in their own terms, and it turns them
into fetches, so the hints of the two compare:
- released by the coordinator: the trace's distance to the unit's next use, one fetch per use
  between (each use of a released unit fetches it once); far when the trace does not use it
  again;
- read by the optimizer worker: after the steps queued before it, each as many fetches as
  that unit's step makes (`set_step_fetches`: its tiles, its values, a gradient kept in the
  store);
- stepped during backward: needed where the next pass first uses it (`next_pass`: the
  coordinator's trace; the same pass follows), never before; with no trace, last.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from infinity.store import TensorStore

FAR = float(1 << 30)  # a use the current trace does not hold: after everything it does


class NextUseClock:
    """Next-use hints for units' values keys, in store fetches (see the module docstring).
    Thread-safe (the store's calls are); holds no lock of its own."""

    def __init__(self, store: TensorStore, *,
                 next_pass: Callable[[str], int | None] | None = None) -> None:
        """next_pass(key): fetches from now until the next pass first uses the unit (None: no
        trace says)."""
        self._store = store
        self._next_pass = next_pass
        self._step_fetches: dict[str, int] = {}

    def set_step_fetches(self, counts: Mapping[str, int]) -> None:
        """The store fetches one optimizer step of each unit makes, by values key (a unit not
        given counts one)."""
        self._step_fetches = dict(counts)

    def step_fetches(self, key: str) -> int:
        return self._step_fetches.get(key, 1)

    def released(self, key: str, uses_until_next: int | None) -> None:
        """A unit was released: the trace uses it again after `uses_until_next` uses (None:
        not in this trace)."""
        self._store.set_next_use({key: FAR if uses_until_next is None else float(uses_until_next)})

    def read_by_optimizer(self, keys: Sequence[str], *, after: Iterable[str] = ()) -> None:
        """The optimizer worker reads these units' values one step after another, in order,
        once the steps of the units `after` (queued before them) are done."""
        distance = sum(self.step_fetches(k) for k in after)
        hints = {}
        for key in keys:
            hints[key] = float(distance + 1)
            distance += self.step_fetches(key)
        self._store.set_next_use(hints)

    def stepped(self, key: str) -> None:
        """The unit was stepped during backward: nothing reads it before the next pass, which
        uses it where the trace says. Saying "last" instead made a host tier that holds every
        value evict these first and read them again each step (the optimizer's tiles, needed a
        whole step later, stayed)."""
        uses = self._next_pass(key) if self._next_pass is not None else None
        self._store.set_next_use({key: math.inf if uses is None else float(uses)})
