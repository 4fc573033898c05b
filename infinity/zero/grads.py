"""Where a unit's gradient is accumulated between optimizer steps: in RAM (the default) or in
the store, at home on NVMe, when the host memory budget cannot hold every gradient.

Both take the parameters' gradients into one flat buffer (summed over micro-batches, in the
unit's compute dtype) and hand it to the optimizer through `read()`.

With several ranks the buffer holds either the whole unit's gradient, averaged over the ranks
once per step by `average_over` (stages 0 and 1), or only this rank's shard (`scatter`, stages
2 and 3): each micro-batch's gradient is then reduce-scattered as soon as it is final and the
averaged shard is added (see [Note: shards of a unit] in infinity.zero.ranks).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from infinity.store import TensorStore, Tier
from infinity.zero.ranks import Ranks

if TYPE_CHECKING:
    from infinity.zero.unit import ParamSlot


class GradBuffer(ABC):
    """A unit's flat gradient. `has_grad` is False until the first gradient of a step.

    `numel` is the unit's elements, or with `scatter` the elements of this rank's (padded)
    shard; `name` names the unit in collective errors."""

    def __init__(self, numel: int, dtype: torch.dtype, *, scatter: Ranks | None = None,
                 name: str = "") -> None:
        self.numel, self.dtype = numel, dtype
        self.scatter, self.name = scatter, name
        self.has_grad = False

    def accumulate(self, slots: Sequence[ParamSlot]) -> None:
        """Add each parameter's `.grad` into its slice (with `scatter`: the averaged shard of
        them all) and set `.grad` to None."""
        if not any(s.param.grad is not None for s in slots):
            return
        if self.scatter is not None:
            self._accumulate_shard(slots, self.scatter)
            return
        with self._writable() as flat:
            first = not self.has_grad  # the buffer holds the previous step's values: overwrite
            if first and any(s.param.grad is None for s in slots):
                flat.zero_()  # a parameter without a gradient this step contributes zeros
            for s in slots:
                g = s.param.grad
                if g is not None:
                    piece = flat[s.offset:s.offset + s.shape.numel()]
                    g = g.detach().reshape(-1)
                    if first:
                        piece.copy_(g)  # copy_ moves device gradients to the host itself
                    else:
                        piece.add_(g.to("cpu"))
                    s.param.grad = None
        self.has_grad = True

    def _accumulate_shard(self, slots: Sequence[ParamSlot], ranks: Ranks) -> None:
        device = next(s.param.grad.device for s in slots if s.param.grad is not None)
        full = torch.zeros(self.numel * ranks.world, dtype=self.dtype, device=device)  # padded
        for s in slots:
            g = s.param.grad
            if g is not None:
                full[s.offset:s.offset + s.shape.numel()].copy_(g.detach().reshape(-1))
                s.param.grad = None
        shard = ranks.reduce_scatter_mean(full, f"gradient {self.name}").to("cpu")
        with self._writable() as flat:
            if self.has_grad:
                flat.add_(shard)
            else:
                flat.copy_(shard)
        self.has_grad = True

    def average_over(self, ranks: Ranks) -> None:
        """Replace the gradient by its average over the ranks (zeros count where nothing
        arrived, so every rank takes part whatever reached it)."""
        with self._writable() as flat:
            if not self.has_grad:
                flat.zero_()
            ranks.all_reduce_mean_(flat, f"gradient {self.name}")
        self.has_grad = True

    @contextlib.contextmanager
    def read(self) -> Iterator[torch.Tensor]:
        """The flat gradient (zeros when nothing arrived this step), valid inside the block."""
        if not self.has_grad:
            yield torch.zeros(self.numel, dtype=self.dtype)
            return
        with self._readable() as flat:
            yield flat

    def zero(self) -> None:
        """Start a new step (the contents are cleared by the next accumulate)."""
        self.has_grad = False

    @abstractmethod
    def _writable(self) -> contextlib.AbstractContextManager[torch.Tensor]: ...

    @abstractmethod
    def _readable(self) -> contextlib.AbstractContextManager[torch.Tensor]: ...


class RamGrad(GradBuffer):
    """The gradient in an ordinary host tensor."""

    def __init__(self, numel: int, dtype: torch.dtype, *, scatter: Ranks | None = None,
                 name: str = "") -> None:
        super().__init__(numel, dtype, scatter=scatter, name=name)
        self.tensor = torch.zeros(numel, dtype=dtype)  # 1D

    @contextlib.contextmanager
    def _writable(self) -> Iterator[torch.Tensor]:
        yield self.tensor

    _readable = _writable


class StoredGrad(GradBuffer):
    """The gradient as a store entry at home on `home` (NVMe), fetched to the host to add to or
    read, written back after each add."""

    def __init__(self, key: str, numel: int, dtype: torch.dtype, store: TensorStore, home: Tier, *,
                 scatter: Ranks | None = None, name: str = "") -> None:
        super().__init__(numel, dtype, scatter=scatter, name=name)
        self.key, self.store = key, store
        store.put(key, torch.zeros(numel, dtype=dtype), home)

    @contextlib.contextmanager
    def _fetched(self, *, dirty: bool) -> Iterator[torch.Tensor]:
        flat = self.store.fetch(self.key, Tier.HOST).result()
        try:
            yield flat
        finally:
            self.store.release(self.key, Tier.HOST, dirty=dirty)

    def _writable(self) -> contextlib.AbstractContextManager[torch.Tensor]:
        return self._fetched(dirty=True)

    def _readable(self) -> contextlib.AbstractContextManager[torch.Tensor]:
        return self._fetched(dirty=False)
