"""A swapped optimizer's tiles in its store: one entry per tile, and the step each holds.

[Note: retry-safe steps] Each tile records the step it holds (`TileSet.steps`). A pass updates
only tiles below the step being built, so after a pass raised (an I/O error on a read or a
write-back) the same call with the same gradients finishes the step and updates no tile twice.
Everything a pass fetches is released on every path; a tile (or values entry) is released
dirty once changed, and the store keeps a changed copy until its write-back succeeds. A pass
(and `flush()`) rewrites any entry of an already-updated tile whose write-back failed.

[Note: where a step writes] A step changes the store in two places only: a tile, inside
`TileSet.updating` (which records the step it then holds), and the unit's values, through
`UnitValues` (released dirty once modified). A speculative step (one that may be undone, see
[Note: speculative steps] in `_kept`) has the store keep the tile's bytes first
(`keep`: `TensorStore.keep`; on NVMe the new state is written back to a
fresh extent, the old one untouched) until `commit(u)` lets them go or `roll_back(u)` makes
them the tile's state again, with the step they held. The values are kept by `_kept.KeptValues`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from infinity.optim._format import StateFormat
from infinity.optim._tiles import Tile, TileFormat, UnitSpec, cut_units, format_for
from infinity.optim._values import UnitValues
from infinity.store import TensorStore, Tier


class TileSet:
    """The tiles of every unit (cut per unit, units in order), their keys in the store
    (`name/tile<t>`), their formats, and the step each holds. Indexing gives a `Tile`."""

    def __init__(self, store: TensorStore, units: Sequence[UnitSpec], tile_numel: int,
                 name: str, tier: Tier, state_format: StateFormat | None = None) -> None:
        self.store, self.name, self.tier = store, name, tier
        self.tiles = cut_units([u.numel for u in units], tile_numel)
        self.formats = [format_for(u.dtype, state_format) for u in units]
        self.of_unit: list[list[int]] = [[] for _ in units]  # each unit's tiles, in order
        for t, tile in enumerate(self.tiles):
            self.of_unit[tile.unit].append(t)
        self.steps = [0] * len(self.tiles)  # See [Note: retry-safe steps]
        self._previous: dict[int, int] = {}  # tile -> the step of its kept bytes, until decided

    def __len__(self) -> int:
        return len(self.tiles)

    def __getitem__(self, t: int) -> Tile:
        return self.tiles[t]

    def key(self, t: int) -> str:
        """The store key of tile t's state."""
        return f"{self.name}/tile{t}"

    def format(self, t: int) -> TileFormat:
        return self.formats[self.tiles[t].unit]

    def nbytes(self) -> int:
        """Bytes of every tile: the state's real size in the store."""
        return sum(self.format(t).nbytes(tile.numel) for t, tile in enumerate(self.tiles))

    def check_budget(self, tile_numel: int) -> None:
        """With the tiles at home on NVMe, the host tier must hold 3 of them to stream."""
        if self.tier == Tier.HOST:
            if not self.store.budgets.get(Tier.HOST):
                raise ValueError("state_tier HOST needs a store with a host budget")
            return
        if not self.store.budgets.get(Tier.NVME):
            raise ValueError("SwappedOptimizer needs a store with an NVMe budget for its state "
                             "(or state_tier=Tier.HOST)")
        tile_nbytes, t = max((self.format(t).nbytes(tile.numel), t)
                             for t, tile in enumerate(self.tiles))
        host = self.store.budgets.get(Tier.HOST, 0)
        if len(self.tiles) > 1 and host < 3 * tile_nbytes:
            per_element = tile_nbytes // self.tiles[t].numel
            raise ValueError(
                f"the store's host budget ({host} bytes) must hold at least 3 optimizer tiles of "
                f"{tile_nbytes} bytes (tile_numel={tile_numel}: {per_element} bytes per element) "
                f"to stream; raise the host budget or lower tile_numel (sub_group_size)"
            )

    def write_initial(self, values: UnitValues) -> None:
        """Put every tile before the first step (masters from the values); on any error none
        is left in the store."""
        try:
            for u, tiles in enumerate(self.of_unit):
                fmt = self.formats[u]
                for t in tiles:
                    tile = self.tiles[t]
                    master = values.get(u)[tile.start:tile.stop] if fmt.has_master else None
                    entry = fmt.new(tile.numel, master)
                    if t == tiles[-1]:
                        values.release(u)  # before the put: the host tier may need the room
                    self.store.put(self.key(t), entry, self.tier)
        except BaseException:
            for t in range(len(self.tiles)):
                if self.key(t) in self.store:
                    self.store.drop(self.key(t))
            raise
        finally:
            values.release_all()

    def loaded(self, step: int) -> None:
        """A state was loaded into every tile: they all hold `step`."""
        self.steps = [step] * len(self.tiles)

    def pending(self, u: int, step: int) -> list[int]:
        """Unit u's tiles that do not hold `step` yet."""
        return [t for t in self.of_unit[u] if self.steps[t] < step]

    def keep(self, t: int) -> None:
        """Have the store keep tile t's bytes as they are (BudgetError: no room, nothing kept),
        once per speculative step (a retried pass finds them kept), until `commit` or
        `roll_back`; on NVMe nothing is read for it."""
        if t not in self._previous:
            self.store.keep(self.key(t))
            self._previous[t] = self.steps[t]

    @contextlib.contextmanager
    def updating(self, t: int, step: int) -> Iterator[torch.Tensor]:
        """Tile t's entry, to be updated in place to `step` by the block: it holds `step` once
        the block ends, and is released dirty on every path once its bytes were handed out
        (see [Note: where a step writes])."""
        with self.store.hold(self.key(t), Tier.HOST, dirty=True) as tile:
            yield tile
            self.steps[t] = step

    def commit(self, u: int) -> None:
        """Unit u's kept tiles are final: their kept bytes go (no I/O)."""
        for t in self.of_unit[u]:
            if t in self._previous:
                self.store.commit(self.key(t))
                del self._previous[t]

    def roll_back(self, u: int) -> None:
        """Unit u's kept tiles go back to their kept bytes and the steps they held (so the same
        step updates them again)."""
        for t in self.of_unit[u]:
            if t in self._previous:
                self.store.rollback(self.key(t))
                self.steps[t] = self._previous.pop(t)

    def rewrite_if_unsaved(self, key: str) -> None:
        """Start the write-back again of an entry whose last one failed (the store kept the
        changed host copy)."""
        if self.store.unsaved(key):
            with self.store.hold(key, Tier.HOST, dirty=True):
                pass
