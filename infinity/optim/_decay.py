"""Weight decay by element range within a unit, and the kernels of one unit's step.

A client optimizer's parameter groups give weights a decay and biases and norms none, and one
unit may hold both: `SwappedOptimizer.set_weight_decay` gives ranges of a unit's elements their
own decay (`DecaySpan`), the other elements keep the optimizer's. A unit's step then has one
kernel per weight decay its elements take (`UnitKernels`), and each kernel call of a tile is cut
where the decay changes (`TileFormat.step`).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

from infinity.optim._native import AdamKernel, StateKernel

Kernel = AdamKernel | StateKernel  # a tile format's kernel (TileFormat.kernel)


class DecaySpan(NamedTuple):
    """Elements [start, stop) of a unit, stepped with their own weight decay."""

    start: int
    stop: int
    weight_decay: float


def check_spans(u: int, spans: Sequence[DecaySpan], numel: int) -> list[DecaySpan]:
    """`spans` sorted; ValueError unless they are disjoint ranges within [0, numel)."""
    checked = sorted(DecaySpan(int(a), int(b), float(wd)) for a, b, wd in spans)
    end = 0
    for span in checked:
        if not end <= span.start < span.stop <= numel:
            raise ValueError(f"unit {u}: weight decay spans must be disjoint ranges within "
                             f"[0, {numel}), got {span[:2]}")
        end = span.stop
    return checked


class UnitKernels:
    """One unit's kernels for one step, one per weight decay, all made before any tile is
    touched (a bad value fails there): `make(weight_decay)` builds one; elements no span
    covers take `default`."""

    def __init__(self, make: Callable[[float], Kernel], default: float,
                 spans: Sequence[DecaySpan] = ()) -> None:
        self.default, self.spans = default, spans
        self.stops = [span.stop for span in spans]
        self.kernels = {wd: make(wd) for wd in {default, *(s.weight_decay for s in spans)}}

    def ranges(self, start: int, stop: int) -> Iterator[tuple[int, int, Kernel]]:
        """[start, stop) of the unit cut where its weight decay changes: (lo, hi, the kernel of
        elements [lo, hi)), in order."""
        at = start
        for span in itertools.islice(self.spans, bisect.bisect_right(self.stops, start), None):
            if span.start >= stop:
                break
            if span.start > at:
                yield at, span.start, self.kernels[self.default]
            hi = min(stop, span.stop)
            yield max(at, span.start), hi, self.kernels[span.weight_decay]
            at = hi
        if at < stop:
            yield at, stop, self.kernels[self.default]
