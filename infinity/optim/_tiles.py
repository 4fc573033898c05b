"""How the swapped optimizer cuts each unit's Adam state into tiles, and what a tile holds.

[Note: tile formats] A tile is one store entry holding the state of elements [start, stop) of
one unit, in the rows of its `TileFormat`. Today the rows are float32: master, exp_avg and
exp_avg_sq for a bf16/fp16 unit; exp_avg and exp_avg_sq for a float32 unit, whose values entry
is its master. Everything that depends on how rows are stored goes through the format: the
bytes of a tile (`nbytes`, which the host budget check uses), a new tile (`new`), the update
(`step`, the kernel calls) and the float32 rows that checkpoints read and write (`read_rows`,
`write_rows`: views today, dequantized and requantized copies for a compressed format). A
format that stores rows otherwise (bf16 or block-quantized moments with per-block scales, no
master) is another TileFormat: the streaming, the retry-safe step record and the checkpoint
streaming in `swapped` and `_state` stay as they are.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.autograd.graph import increment_version

from infinity.optim._decay import UnitKernels
from infinity.optim._grads import GradPieces


class UnitSpec(NamedTuple):
    """One engine fetch unit: a module's parameters flattened into one 1-D store entry; or,
    with several data-parallel ranks, the slice of it this rank's optimizer owns."""

    numel: int  # elements stepped: the unit's flat values, or this rank's slice of them
    dtype: torch.dtype  # float32 / bfloat16 / float16, as the model stores them
    values_key: str  # store key of a 1-D entry of `dtype` holding the unit's values
    offset: int = 0  # first element stepped in the values entry (it holds offset + numel or more)


class Tile(NamedTuple):
    """Elements [start, stop) of one unit's state: the I/O unit of a step."""

    unit: int
    start: int  # first element, in the unit's elements stepped
    numel: int

    @property
    def stop(self) -> int:
        return self.start + self.numel


def cut_units(numels: Sequence[int], tile_numel: int) -> list[Tile]:
    """Each unit cut on its own into tiles of at most `tile_numel` elements, units in order: a
    tile never spans two units, so a unit can be stepped as soon as its gradient is final."""
    return [Tile(u, start, min(tile_numel, numel - start))
            for u, numel in enumerate(numels) for start in range(0, numel, tile_numel)]


class TileFormat:
    """The rows a tile's store entry holds and how; see [Note: tile formats]."""

    def __init__(self, rows: tuple[str, ...]) -> None:
        self.rows = rows

    @property
    def has_master(self) -> bool:
        """The tiles keep the fp32 master (else the unit's float32 values are the master)."""
        return "master" in self.rows

    def nbytes(self, numel: int) -> int:
        """Bytes of the store entry of a tile of `numel` elements."""
        return len(self.rows) * 4 * numel

    def new(self, numel: int, master: torch.Tensor | None) -> torch.Tensor:
        """A tile before the first step: zero moments, the master from the values (upcast)."""
        tile = torch.zeros(len(self.rows), numel)
        if self.has_master:
            tile[0].copy_(master)
        return tile

    def read_rows(self, tile: torch.Tensor) -> dict[str, torch.Tensor]:
        """The tile's rows by name as float32, for a checkpoint to save (views: not to be
        written)."""
        return dict(zip(self.rows, tile, strict=True))

    def write_rows(self, tile: torch.Tensor, fill: Callable[[str, torch.Tensor], None]) -> None:
        """Set every row from float32 values: `fill(name, out)` writes the row's values into
        `out` (a checkpoint being loaded, one tile at a time)."""
        for name, row in zip(self.rows, tile, strict=True):
            fill(name, row)

    def step(self, kernels: UnitKernels, tile: torch.Tensor, values: torch.Tensor,
             grad: GradPieces, start: int) -> None:
        """Update the tile and `values` (its elements of the unit's values) from the gradient
        of elements [start, start + len(values)) of the unit, one kernel call per gradient
        piece and weight decay range. Every input is fetched and checked already (see
        AdamKernel)."""
        rows = dict(zip(self.rows, tile, strict=True))
        master = rows["master"] if self.has_master else values
        lowp = values if self.has_master else None  # new values rounded from the master
        for first, g in grad.ranges(start, start + values.numel()):
            for lo, hi, kernel in kernels.ranges(first, first + g.numel()):
                at = slice(lo - start, hi - start)
                kernel(master[at], g[lo - first:hi - first], rows["exp_avg"][at],
                       rows["exp_avg_sq"][at], None if lowp is None else lowp[at])
        increment_version(values)  # as an in-place op would: a graph that saved them fails loudly


MASTER_AND_MOMENTS = TileFormat(("master", "exp_avg", "exp_avg_sq"))
MOMENTS = TileFormat(("exp_avg", "exp_avg_sq"))
STATE_ROWS = MASTER_AND_MOMENTS.rows  # what iter_state yields and load_state takes, per unit


def format_for(dtype: torch.dtype) -> TileFormat:
    """A float32 unit's values entry is its master: its tiles hold the moments (8 B/element);
    a bf16/fp16 unit's tiles hold an fp32 master too (12 B/element)."""
    return MOMENTS if dtype == torch.float32 else MASTER_AND_MOMENTS
