"""Streaming a SwappedOptimizer's state in and out one parameter (or unit) at a time: for
checkpoints and torch's state-dict format, holding one entry's state and one tile in memory."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol

import torch

from infinity.optim._tiles import GroupValues, spans
from infinity.store import Tier

MASTER_ROWS = ("master", "exp_avg", "exp_avg_sq")  # tiles of param mode and low-precision units
MOMENT_ROWS = ("exp_avg", "exp_avg_sq")  # tiles of float32 units: the values entry is the master


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


class StreamedState:
    """Mixin of SwappedOptimizer: iter_state / load_state / state_dict / load_state_dict.

    Uses the optimizer's groups (`_shapes`, `_numels`, `_master_row`, `_by_group`, `_host`),
    its store, `_key`, `_values`, `flush` and step counters."""

    def _group_step(self, i: int) -> int:
        return self.steps[i] if self.params is not None else self._completed

    def iter_state(self) -> Iterator[tuple[int, dict[str, Any]]]:
        """Yield (index, {"step", "master", "exp_avg", "exp_avg_sq"}) one parameter (param mode)
        or unit (unit mode) at a time: memory holds one such state and one tile."""
        for i in range(len(self._shapes)):
            yield i, self._group_state(i)

    def _group_state(self, i: int) -> dict[str, Any]:
        state = {name: torch.empty(self._shapes[i], dtype=torch.float32) for name in MASTER_ROWS}
        rows = MASTER_ROWS if self._master_row[i] else MOMENT_ROWS
        for t, seg in self._by_group[i]:
            key = self._key(t)
            future = self.store.fetch(key, Tier.HOST)
            try:
                tile = future.result()
                part, cols = spans(seg)
                for row, name in enumerate(rows):
                    state[name].view(-1)[part] = tile[row, cols]
            finally:
                self.store.release(key, Tier.HOST)
        if not self._master_row[i]:
            values = self._values()
            try:
                state["master"].view(-1).copy_(values.get(i))
            finally:
                values.release_all()
        return {"step": self._group_step(i), **state}

    def load_state(self, states: Iterable[tuple[int, dict[str, Any]]]) -> None:
        """Consume what iter_state yields (in order), writing tiles as they fill. A state
        without "master" keeps the current values (torch state dicts). A row may be a tensor
        or a RowSource, read one tile's segment at a time (memory holds a tile, not a row)."""
        values = self._values()
        held: int | None = None  # a tile spans several parameters in param mode: fetched once
        read = False  # the held tile's bytes arrived (else it is released clean)
        expected, unit_steps = 0, set()
        try:
            for i, state in states:
                if i != expected:
                    raise ValueError(f"load_state expects parameters/units in order: got {i}, expected {expected}")
                expected += 1
                if expected > len(self._shapes):
                    raise ValueError(f"load_state got more than {len(self._shapes)} entries")
                rows = self._loaded_rows(i, state, values)
                for t, seg in self._by_group[i]:
                    if held != t:
                        if held is not None:
                            self.store.release(self._key(held), Tier.HOST, dirty=True)
                            held = None
                        future = self.store.fetch(self._key(t), Tier.HOST)
                        held, read = t, False  # released in `finally` even if the read fails
                        tile = future.result()
                        read = True
                    part, cols = spans(seg)
                    for row, value in enumerate(rows):
                        _copy_range(value, part.start, part.stop, tile[row, cols])
                if self.params is not None:
                    self.steps[i] = int(state["step"])
                unit_steps.add(int(state["step"]))
            if expected != len(self._shapes):
                raise ValueError(f"load_state got {expected} entries, the optimizer has {len(self._shapes)}")
            if self.units is not None:
                if len(unit_steps) != 1:
                    raise ValueError(f"load_state: units hold different steps {sorted(unit_steps)}")
                self._completed = unit_steps.pop()
            self._tile_steps = [self._completed] * len(self.tiles)
        finally:
            try:
                if held is not None:
                    self.store.release(self._key(held), Tier.HOST, dirty=read)
            finally:
                values.release_all()
        self.flush()

    def _loaded_rows(self, i: int, state: dict[str, Any], values: GroupValues) -> list[torch.Tensor | RowSource]:
        """The rows of group i's tiles from a loaded state, checked; a float32 unit's master is
        written into its values entry."""
        master = state.get("master")
        if master is None and self._master_row[i]:
            master = self._host[i].detach() if self._host is not None else values.get(i).float()
        checked = {"exp_avg": state.get("exp_avg"), "exp_avg_sq": state.get("exp_avg_sq")}
        if master is not None:  # absent only for a float32 unit: its values stay as they are
            checked["master"] = master
        for name, value in checked.items():
            if value is None or value.numel() != self._numels[i]:
                got = None if value is None else tuple(getattr(value, "shape", (value.numel(),)))
                raise ValueError(f"param {i}: state {name!r} has shape {got}, expected {tuple(self._shapes[i])}")
        if not self._master_row[i]:
            if master is not None:
                _copy_range(master, 0, self._numels[i], values.get(i))
                values.modified(i)
            values.release(i)
            return [state["exp_avg"], state["exp_avg_sq"]]
        values.release(i)
        return [master, state["exp_avg"], state["exp_avg_sq"]]

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.AdamW's format: state by parameter (or unit) index, plus one param group.

        The "state" mapping is lazy: each entry's moments are read when it is accessed, so
        iterating it (as torch's load_state_dict and checkpoint writers do) holds one at a time.
        torch.save of it materialises everything.
        """
        group = {"lr": self.lr, "betas": self.betas, "eps": self.eps,
                 "weight_decay": self.weight_decay, "amsgrad": False, "maximize": False,
                 "foreach": None, "capturable": False, "differentiable": False, "fused": None,
                 "decoupled_weight_decay": self.adamw_mode, "params": list(range(len(self._shapes)))}
        return {"state": _LazyState(self), "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's Adam/AdamW format (master weights are the current values)."""
        state = state_dict["state"]

        def states() -> Iterator[tuple[int, dict[str, Any]]]:
            for i, shape in enumerate(self._shapes):
                s = state.get(i) or state.get(str(i))
                if s is None:
                    zeros = torch.zeros(shape)
                    yield i, {"step": 0, "exp_avg": zeros, "exp_avg_sq": zeros}
                else:
                    yield i, {"step": int(float(s["step"])), "exp_avg": s["exp_avg"],
                              "exp_avg_sq": s["exp_avg_sq"]}

        self.load_state(states())


class _LazyState(Mapping[int, dict[str, Any]]):
    """torch-format optimizer state, read from the tiles one entry at a time on access."""

    def __init__(self, optimizer: StreamedState) -> None:
        self._opt = optimizer

    def _stepped(self) -> list[int]:
        return [i for i in range(len(self._opt._shapes)) if self._opt._group_step(i)]

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not isinstance(i, int) or not 0 <= i < len(self._opt._shapes) or not self._opt._group_step(i):
            raise KeyError(i)
        s = self._opt._group_state(i)
        return {"step": torch.tensor(float(s["step"])), "exp_avg": s["exp_avg"], "exp_avg_sq": s["exp_avg_sq"]}

    def __iter__(self) -> Iterator[int]:
        return iter(self._stepped())

    def __len__(self) -> int:
        return len(self._stepped())
