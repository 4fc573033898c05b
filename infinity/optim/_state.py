"""A swapped optimizer's state streamed out and in one unit at a time (checkpoints), holding one
unit's state and one tile in memory; rows given as RowSources are read one tile at a time."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from infinity.optim._tile_set import TileSet
from infinity.optim._tiles import STATE_ROWS, UnitSpec
from infinity.optim._values import UnitValues
from infinity.store import Tier


class RowSource(Protocol):
    """A row of state given to `load_state` without being held whole (a checkpoint read tile
    by tile): its element count, and elements [start, stop) copied into `out`."""

    def numel(self) -> int: ...

    def read_into(self, start: int, stop: int, out: torch.Tensor) -> None: ...


def _copy_range(row: torch.Tensor | RowSource, start: int, stop: int, out: torch.Tensor) -> None:
    if isinstance(row, torch.Tensor):
        out.copy_(row.reshape(-1)[start:stop])
    else:
        row.read_into(start, stop, out)


def unit_state(tiles: TileSet, units: list[UnitSpec], u: int) -> dict[str, torch.Tensor]:
    """Unit u's float32 rows (master, exp_avg, exp_avg_sq), read from its tiles (and, for a
    float32 unit, the master from its values)."""
    state = {name: torch.empty(units[u].numel, dtype=torch.float32) for name in STATE_ROWS}
    for t in tiles.of_unit[u]:
        tile = tiles[t]
        with tiles.store.hold(tiles.key(t), Tier.HOST) as entry:
            for name, row in tiles.format(t).read_rows(entry).items():
                state[name][tile.start:tile.stop] = row
    if not tiles.formats[u].has_master:
        values = UnitValues(tiles.store, units)
        try:
            state["master"].copy_(values.get(u))
        finally:
            values.release_all()
    return state


def load_states(tiles: TileSet, units: list[UnitSpec],
                states: Iterable[tuple[int, dict[str, Any]]]) -> int:
    """Write what iter_state yields (every unit, in order) into the tiles (a float32 unit's
    master into its values) as they come; returns the step the states hold."""
    expected, steps = 0, set()
    for u, state in states:
        if u != expected:
            raise ValueError(f"load_state expects units in order: got {u}, expected {expected}")
        expected += 1
        if expected > len(units):
            raise ValueError(f"load_state got more than {len(units)} entries")
        rows = _checked_rows(units[u], u, state)
        if not tiles.formats[u].has_master:
            values = UnitValues(tiles.store, units)
            try:
                master = values.get(u)
                values.modified(u)  # written back even if the copy fails part-way
                _copy_range(rows["master"], 0, units[u].numel, master)
            finally:
                values.release_all()
        for t in tiles.of_unit[u]:
            tile = tiles[t]
            with tiles.store.hold(tiles.key(t), Tier.HOST, dirty=True) as entry:
                tiles.format(t).write_rows(entry, lambda name, out, rows=rows, tile=tile:
                                           _copy_range(rows[name], tile.start, tile.stop, out))
        steps.add(int(state["step"]))
    if expected != len(units):
        raise ValueError(f"load_state got {expected} entries, the optimizer has {len(units)}")
    if len(steps) != 1:
        raise ValueError(f"load_state: units hold different steps {sorted(steps)}")
    return steps.pop()


def _checked_rows(spec: UnitSpec, u: int, state: dict[str, Any]) -> dict[str, Any]:
    rows = {name: state.get(name) for name in STATE_ROWS}
    for name, value in rows.items():
        if value is None or value.numel() != spec.numel:
            got = None if value is None else tuple(getattr(value, "shape", (value.numel(),)))
            raise ValueError(f"unit {u}: state {name!r} has shape {got}, expected "
                             f"({spec.numel},)")
    return rows
