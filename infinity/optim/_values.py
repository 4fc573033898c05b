"""The units' values during one pass over tiles, held once however many tiles a unit spans."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infinity.optim._tiles import UnitSpec
from infinity.store import TensorStore, Tier


class UnitValues:
    """Each unit's values entry, fetched to the host tier on first use and released (written
    back if changed) by `release`, so an entry spanning many tiles is read and written once per
    pass.

    Every fetch is released by `release_all` on every path, modified entries dirty: their tiles
    already record the step, so the new values must reach the store. Not thread-safe: one per
    pass (a pass steps one unit)."""

    def __init__(self, store: TensorStore, units: Sequence[UnitSpec]) -> None:
        self._store, self._units = store, units
        self._held: dict[int, list] = {}  # unit -> [tensor or None while reading, modified]

    def get(self, u: int) -> torch.Tensor:
        """The flat values unit u steps (its slice of the store entry)."""
        held = self._held.get(u)
        if held is None:
            spec = self._units[u]
            future = self._store.fetch(spec.values_key, Tier.HOST)
            held = self._held[u] = [None, False]  # a use is taken: released even if the read fails
            value = future.result()
            start, stop = spec.offset, spec.offset + spec.numel
            if value.numel() < stop or value.dtype != spec.dtype:
                raise ValueError(
                    f"store entry {spec.values_key!r} holds {value.numel()} x {value.dtype}; "
                    f"expected {stop if start == 0 else f'[{start}:{stop}] of'} x {spec.dtype}")
            held[0] = value.view(-1)[start:stop]
        return held[0]

    def modified(self, u: int) -> None:
        if u in self._held:
            self._held[u][1] = True

    def release(self, u: int) -> None:
        held = self._held.pop(u, None)
        if held is not None:
            self._store.release(self._units[u].values_key, Tier.HOST, dirty=held[1])

    def release_all(self) -> None:
        """Release everything still held; raises the first error after trying them all."""
        error = None
        for u in list(self._held):
            try:
                self.release(u)
            except Exception as exc:  # noqa: BLE001 - keep releasing, re-raised below
                error = error or exc
        if error is not None:
            raise error
