"""Where a unit's gradient is accumulated between optimizer steps: in RAM (the default) or in
the store, at home on NVMe, when the host memory budget cannot hold every gradient.

Both take the parameters' gradients into one flat buffer (summed over micro-batches, in the
unit's compute dtype) and hand it to the optimizer through `read()`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from infinity.store import TensorStore, Tier

if TYPE_CHECKING:
    from infinity.zero.unit import ParamSlot


class GradBuffer(ABC):
    """A unit's flat gradient. `has_grad` is False until the first gradient of a step."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.numel, self.dtype = numel, dtype
        self.has_grad = False

    def accumulate(self, slots: Sequence[ParamSlot]) -> None:
        """Add each parameter's `.grad` into its slice and set `.grad` to None."""
        if not any(s.param.grad is not None for s in slots):
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

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        super().__init__(numel, dtype)
        self.tensor = torch.zeros(numel, dtype=dtype)  # 1D

    @contextlib.contextmanager
    def _writable(self) -> Iterator[torch.Tensor]:
        yield self.tensor

    _readable = _writable


class StoredGrad(GradBuffer):
    """The gradient as a store entry at home on `home` (NVMe), fetched to the host to add to or
    read, written back after each add."""

    def __init__(self, key: str, numel: int, dtype: torch.dtype, store: TensorStore, home: Tier) -> None:
        super().__init__(numel, dtype)
        self.key, self.store = key, store
        store.put(key, torch.zeros(numel, dtype=dtype), home)

    @contextlib.contextmanager
    def _writable(self) -> Iterator[torch.Tensor]:
        flat = self.store.fetch(self.key, Tier.HOST).result()
        try:
            yield flat
        finally:
            self.store.release(self.key, Tier.HOST, dirty=True)

    @contextlib.contextmanager
    def _readable(self) -> Iterator[torch.Tensor]:
        flat = self.store.fetch(self.key, Tier.HOST).result()
        try:
            yield flat
        finally:
            self.store.release(self.key, Tier.HOST)
