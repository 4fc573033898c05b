"""Where a unit's gradient is accumulated between optimizer steps: in RAM (the default) or in
the store, at home on NVMe, when the host memory budget cannot hold every gradient.

On one process computing on the CPU, `HeldGrad` keeps the tensors autograd made for the
parameters (summed over micro-batches in place, as `param.grad` is) and hands them to the
optimizer as they are, laid end to end: no copy, and they are freed once the unit is stepped
(measured: copying them into one flat buffer cost ~0.2 s of a 4 s step of a 294M GPT).
`RamGrad` and `StoredGrad` (`FlatGrad`s) take the parameters' gradients into one flat buffer
(summed over micro-batches, in the unit's compute dtype): what collectives over ranks and the
store need.
All hand the gradient to the optimizer through `read_pieces()`.

Each piece's sum of squares (`infinity.optim.sum_squares`, in double) is both its term of the
global norm (clipping, `last_grad_norm`) and its inf/nan check (not finite exactly when the
piece holds one), so one pass serves both: native, it reads the piece's own bytes once on this
thread, where torch converts a bf16 piece into a float32 temporary first
(`tools/bench_grad_norm.py` over the 294M GPT's pieces: 0.08 CPU s against 0.40 for torch's
float32 norm, which was 6e-5 off).

With several ranks the buffer holds either the whole unit's gradient, averaged over the ranks
once per step by `average_over` (stages 0 and 1), or only this rank's shard (`scatter`, stages
2 and 3): each micro-batch's gradient is then reduce-scattered as soon as it is final and the
averaged shard is added (see [Note: shards of a unit] in infinity.zero.ranks).
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from infinity.optim import sum_squares
from infinity.store import TensorStore, Tier
from infinity.zero.ranks import Ranks

if TYPE_CHECKING:
    from infinity.zero.unit import ParamSlot


def pieces_are_finite(pieces: Sequence[torch.Tensor]) -> bool:
    """No inf/nan in a gradient's pieces (`GradBuffer.read_pieces()`): one pass, nothing kept."""
    return all(math.isfinite(sum_squares(p)) for p in pieces)


class GradBuffer(ABC):
    """A unit's gradient between optimizer steps. `has_grad` is False until the first gradient
    of a step; `numel` is the unit's elements (with a FlatGrad's `scatter`: this rank's padded
    shard's); `name` names the unit in errors."""

    def __init__(self, numel: int, dtype: torch.dtype, *, name: str = "") -> None:
        self.numel, self.dtype, self.name = numel, dtype, name
        self.has_grad = False
        # Whether this step's gradient is free of inf/nan, where accumulate checked it (while
        # autograd's output is still in cache: far cheaper than a pass at the optimizer step).
        self.finite: bool | None = None
        # Whether accumulate checks (where it does): the engine checks only at the boundary
        # micro-batch of an accumulation, since inf/nan survive the in-place sums.
        self.check_now = True

    @abstractmethod
    def accumulate(self, slots: Sequence[ParamSlot]) -> None:
        """Add each parameter's `.grad` into the unit's gradient and set `.grad` to None."""

    @abstractmethod
    def read_pieces(self) -> contextlib.AbstractContextManager[list[torch.Tensor]]:
        """The gradient as 1-D tensors laid end to end (zeros when nothing arrived this step),
        valid inside the block."""

    def read_ahead(self) -> None:  # noqa: B027 - a hint; a gradient in RAM needs none
        """Start bringing the gradient into RAM for a `read_pieces` soon, without waiting (a
        hint): nothing to do where it lives in RAM."""

    @contextlib.contextmanager
    def read(self) -> Iterator[torch.Tensor]:
        """The gradient as one flat tensor, valid inside the block."""
        with self.read_pieces() as pieces:
            yield pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def zero(self) -> None:
        """Start a new step (the contents are cleared by the next accumulate)."""
        self.has_grad = False
        self.finite = None

    def square(self) -> float:
        """This step's sum of squares, the term of the global norm the gradient contributes:
        each piece's (`sum_squares`) summed in piece order (0.0 when nothing arrived this
        step)."""
        if not self.has_grad:
            return 0.0
        with self.read_pieces() as pieces:
            return sum(sum_squares(g) for g in pieces)

    def is_finite(self) -> bool:
        """Whether this step's gradient is free of inf/nan: what accumulate found, else one
        pass over it."""
        if self.finite is None:
            with self.read_pieces() as pieces:
                self.finite = pieces_are_finite(pieces)
        return self.finite


class FlatGrad(GradBuffer):
    """The gradient summed into one flat buffer (in RAM the unit's compute dtype, in the store
    its values' dtype: [Note: memory plan] in infinity/engine/_plan.py): what collectives over
    ranks and the store need."""

    def __init__(self, numel: int, dtype: torch.dtype, *, scatter: Ranks | None = None,
                 name: str = "") -> None:
        super().__init__(numel, dtype, name=name)
        self.scatter = scatter
        # The sum of squares where accumulate last wrote the buffer with `check_now` (None: not
        # taken since it changed): in a StoredGrad, reading the buffer back for `square()`
        # waited on the store (~0.2 s of the training thread a step on the 294M GPT).
        self._square: float | None = None

    def accumulate(self, slots: Sequence[ParamSlot]) -> None:
        """Add each parameter's `.grad` into its slice (with `scatter`: the averaged shard of
        them all) and set `.grad` to None; with `check_now`, take the sum's square and
        finiteness while it is in hand."""
        if not any(s.param.grad is not None for s in slots):
            return
        self._changed()
        shard = None if self.scatter is None else self._reduced_shard(slots, self.scatter)
        first = not self.has_grad  # the buffer holds the previous step's values: overwrite
        with self._writable(overwrite=first) as flat:
            if shard is not None:
                if first:
                    flat.copy_(shard)
                else:
                    flat.add_(shard)
            else:
                self._add_slots(flat, slots, first)
            if self.check_now:
                self._square = sum_squares(flat)
                self.finite = math.isfinite(self._square)
        self.has_grad = True

    @staticmethod
    def _add_slots(flat: torch.Tensor, slots: Sequence[ParamSlot], first: bool) -> None:
        """Each parameter's `.grad` into its slice (`first`: over the last step's values)."""
        arrived = sum(s.shape.numel() for s in slots if s.param.grad is not None)
        if first and arrived != flat.numel():
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

    def _changed(self) -> None:
        """The values are changing: the square taken before is gone, and so is a finding of
        finite (one of inf/nan stays true: they survive sums and averages)."""
        self._square = None
        if self.finite:
            self.finite = None

    def square(self) -> float:
        if self._square is not None:
            return self._square
        return super().square()

    def zero(self) -> None:
        super().zero()
        self._square = None

    def _reduced_shard(self, slots: Sequence[ParamSlot], ranks: Ranks) -> torch.Tensor:
        """This rank's shard of the gradients averaged over the ranks, on the host; `.grad`
        set to None."""
        first = next(s.param.grad for s in slots if s.param.grad is not None)
        # reduced in the gradients' own dtype, whatever the buffer keeps (padded)
        full = torch.zeros(self.numel * ranks.world, dtype=first.dtype, device=first.device)
        for s in slots:
            g = s.param.grad
            if g is not None:
                full[s.offset:s.offset + s.shape.numel()].copy_(g.detach().reshape(-1))
                s.param.grad = None
        return ranks.reduce_scatter_mean(full, f"gradient {self.name}").to("cpu")

    def average_over(self, ranks: Ranks) -> None:
        """Replace the gradient by its average over the ranks (zeros count where nothing
        arrived, so every rank takes part whatever reached it)."""
        self._changed()  # another rank's inf/nan may arrive
        with self._writable(overwrite=not self.has_grad) as flat:
            if not self.has_grad:
                flat.zero_()
            ranks.all_reduce_mean_(flat, f"gradient {self.name}")
        self.has_grad = True

    @contextlib.contextmanager
    def read_pieces(self) -> Iterator[list[torch.Tensor]]:
        if not self.has_grad:
            yield [torch.zeros(self.numel, dtype=self.dtype)]
            return
        with self._readable() as flat:
            yield [flat]

    @abstractmethod
    def _writable(self, *, overwrite: bool = False
                  ) -> contextlib.AbstractContextManager[torch.Tensor]:
        """The buffer to change; overwrite: every element is written, the old ones unread."""

    @abstractmethod
    def _readable(self) -> contextlib.AbstractContextManager[torch.Tensor]: ...


class RamGrad(FlatGrad):
    """The gradient in an ordinary host tensor."""

    def __init__(self, numel: int, dtype: torch.dtype, *, scatter: Ranks | None = None,
                 name: str = "") -> None:
        super().__init__(numel, dtype, scatter=scatter, name=name)
        self.tensor = torch.zeros(numel, dtype=dtype)  # 1D

    @contextlib.contextmanager
    def _writable(self, *, overwrite: bool = False) -> Iterator[torch.Tensor]:
        yield self.tensor

    _readable = _writable


class StoredGrad(FlatGrad):
    """The gradient as a store entry at home on `home` (NVMe), fetched to the host to add to or
    read, written back after each add. A step's first gradient overwrites the entry whole, so
    the last step's is not read in for it (a read of every gradient a step saved)."""

    def __init__(self, key: str, numel: int, dtype: torch.dtype, store: TensorStore, home: Tier, *,
                 scatter: Ranks | None = None, name: str = "") -> None:
        super().__init__(numel, dtype, scatter=scatter, name=name)
        self.key, self.store = key, store
        store.put(key, torch.zeros(numel, dtype=dtype), home)

    def _writable(self, *, overwrite: bool = False
                  ) -> contextlib.AbstractContextManager[torch.Tensor]:
        return self.store.hold(self.key, Tier.HOST, dirty=True, overwrite=overwrite)

    def _readable(self) -> contextlib.AbstractContextManager[torch.Tensor]:
        return self.store.hold(self.key, Tier.HOST)

    def read_ahead(self) -> None:
        if self.has_grad:  # (else read_pieces reads nothing)
            self.store.prefetch([self.key], Tier.HOST)


class HeldGrad(GradBuffer):
    """The parameters' own gradient tensors, taken from `.grad` as autograd made them (one
    process, CPU compute): `read_pieces()` yields them in slot order, zeros for a parameter that
    got none; `zero()` lets them go."""

    def __init__(self, slot_numels: Sequence[int], dtype: torch.dtype, *, name: str = "") -> None:
        super().__init__(sum(slot_numels), dtype, name=name)
        self._numels = list(slot_numels)
        self._pieces: list[torch.Tensor | None] = [None] * len(self._numels)
        self._unchecked: set[int] = set()  # pieces added into since they were last checked
        # each piece's sum of squares where its check took it (None: not since it changed)
        self._squares: list[float | None] = [None] * len(self._numels)

    def accumulate(self, slots: Sequence[ParamSlot]) -> None:
        for k, s in enumerate(slots):
            g = s.param.grad
            if g is None:
                continue
            s.param.grad = None
            g = g.detach()
            if g.device.type != "cpu" or g.dtype != self.dtype or not g.is_contiguous():
                g = g.to("cpu", self.dtype).contiguous()
            g = g.view(-1)
            held = self._pieces[k] if self.has_grad else None
            if held is None:
                # autograd gave it to .grad alone: ours to keep and add into
                self._pieces[k] = held = g
            else:
                held.add_(g)
            self._squares[k] = None
            self._unchecked.add(k)
            if self.check_now:
                self._check(k)  # while the sum is still in cache
            elif self.finite:
                self.finite = None  # unknown again until checked
        if self.check_now:  # pieces no gradient reached this time hold unchecked sums too
            for k in list(self._unchecked):
                self._check(k)
        self.has_grad = True

    def _check(self, k: int) -> None:
        """Check piece k through its sum of squares, kept for `square()` (taken at the boundary,
        where the check runs): one pass serves both."""
        self._squares[k] = square = sum_squares(self._pieces[k])
        self.finite = math.isfinite(square) and self.finite is not False
        self._unchecked.discard(k)

    def square(self) -> float:
        if not self.has_grad:
            return 0.0
        return sum(0.0 if g is None else sum_squares(g) if q is None else q
                   for g, q in zip(self._pieces, self._squares))

    @contextlib.contextmanager
    def read_pieces(self) -> Iterator[list[torch.Tensor]]:
        held = self._pieces if self.has_grad else [None] * len(self._numels)
        yield [torch.zeros(n, dtype=self.dtype) if g is None else g
               for g, n in zip(held, self._numels)]

    def zero(self) -> None:
        super().zero()
        self._pieces = [None] * len(self._numels)
        self._squares = [None] * len(self._numels)
        self._unchecked.clear()
