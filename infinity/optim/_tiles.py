"""How the swapped optimizer cuts each unit's Adam state into tiles, and what a tile holds.

[Note: tile formats] A tile is one store entry holding the state of elements [start, stop) of
one unit, in the rows of its `TileFormat`. Today the rows are float32: master, exp_avg and
exp_avg_sq for a bf16/fp16 unit; exp_avg and exp_avg_sq for a float32 unit, whose values entry
is its master. Everything that depends on how rows are stored goes through the format: the
bytes of a tile (`nbytes`, which the host budget check uses), a new tile (`new`), the update
(`kernel` and `step`) and the float32 rows that checkpoints read and write (`read_rows`,
`write_rows`: views for float32 rows, dequantized and requantized copies for a compressed
format). `PackedTileFormat` stores a `StateFormat` other than the default (bf16 or 8-bit
moments, or no master: one uint8 entry per tile, [Note: tile layout] in `_format`); the
streaming, the retry-safe step record and the checkpoint streaming in `swapped` and `_state`
are the same for every format.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.autograd.graph import increment_version

from infinity.optim._decay import UnitKernels
from infinity.optim._format import StateFormat, TileLayout
from infinity.optim._grads import GradPieces
from infinity.optim._native import AdamKernel, StateKernel
from infinity.optim._quant import EXP_AVG_CODE, EXP_AVG_SQ_CODE, dequantize, quantize


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

    def read_rows(self, tile: torch.Tensor, numel: int) -> dict[str, torch.Tensor]:
        """The rows by name as float32 of a tile of `numel` elements, for a checkpoint to save
        (not to be written: they may be views)."""
        return dict(zip(self.rows, tile, strict=True))

    def write_rows(self, tile: torch.Tensor, numel: int,
                   fill: Callable[[str, torch.Tensor], None]) -> None:
        """Set every row of a tile of `numel` elements from float32 values: `fill(name, out)`
        writes the row's values into `out` (a checkpoint being loaded, one tile at a time)."""
        for name, row in zip(self.rows, tile, strict=True):
            fill(name, row)

    def kernel(self, *, seed: int, **hyper: object) -> AdamKernel:
        """The step's kernel (hyperparameters as AdamKernel's; float32 rows round no values
        stochastically, so `seed` is moot)."""
        return AdamKernel(**hyper)

    def step(self, kernels: UnitKernels, tile: torch.Tensor, values: torch.Tensor,
             grad: GradPieces, start: int, index: int) -> None:
        """Update the tile and `values` (its elements of the unit's values) from the gradient
        of elements [start, start + len(values)) of the unit, one kernel call per gradient
        piece and weight decay range. Every input is fetched and checked already (see
        AdamKernel). `index`: the stochastic rounding counter of the tile's first element
        (`PackedTileFormat`)."""
        rows = dict(zip(self.rows, tile, strict=True))
        master = rows["master"] if self.has_master else values
        lowp = values if self.has_master else None  # new values rounded from the master
        for first, g in grad.ranges(start, start + values.numel()):
            for lo, hi, kernel in kernels.ranges(first, first + g.numel()):
                at = slice(lo - start, hi - start)
                kernel(master[at], g[lo - first:hi - first], rows["exp_avg"][at],
                       rows["exp_avg_sq"][at], None if lowp is None else lowp[at])
        increment_version(values)  # as an in-place op would: a graph that saved them fails loudly


class PackedTileFormat(TileFormat):
    """A tile in a `StateFormat` other than the default: one uint8 entry of the rows its
    `TileLayout` places, updated by `StateKernel`'s fused pass (one call per tile and weight
    decay range; for 8-bit moments a tile is whole blocks but for its end). Checkpoint rows are
    float32: bf16 moments widen and narrow exactly; 8-bit ones dequantize, and quantize back to
    the same bytes (the block's largest element decodes to its scale exactly, and every other
    one lies far closer to its own code than to a neighbour; a scale below the normal floats,
    1e-38, may lose that)."""

    def __init__(self, state: StateFormat, values_dtype: torch.dtype) -> None:
        master = ("master",) if state.keeps_master(values_dtype) else ()
        super().__init__((*master, "exp_avg", "exp_avg_sq"))
        self.state, self.values_dtype = state, values_dtype

    def layout(self, numel: int) -> TileLayout:
        return self.state.layout(numel, self.values_dtype)

    def nbytes(self, numel: int) -> int:
        return self.layout(numel).nbytes

    def new(self, numel: int, master: torch.Tensor | None) -> torch.Tensor:
        layout = self.layout(numel)
        tile = torch.zeros(layout.nbytes, dtype=torch.uint8)  # zero bytes: Adam's first state
        if self.has_master:
            layout.views(tile)["master"].copy_(master)
        return tile

    def read_rows(self, tile: torch.Tensor, numel: int) -> dict[str, torch.Tensor]:
        views = self.layout(numel).views(tile)
        rows = {"master": views["master"]} if self.has_master else {}
        for name, code in (("exp_avg", EXP_AVG_CODE), ("exp_avg_sq", EXP_AVG_SQ_CODE)):
            if self.state.quantized:
                rows[name] = dequantize(views[name], views[f"{name}_scale"], self.state.block,
                                        code)
            else:
                rows[name] = views[name].float()
        return rows

    def write_rows(self, tile: torch.Tensor, numel: int,
                   fill: Callable[[str, torch.Tensor], None]) -> None:
        views = self.layout(numel).views(tile)
        if self.has_master:
            fill("master", views["master"])
        row = torch.empty(numel)
        for name, code in (("exp_avg", EXP_AVG_CODE), ("exp_avg_sq", EXP_AVG_SQ_CODE)):
            fill(name, row)
            if self.state.quantized:
                codes, scales = quantize(row, self.state.block, code)
                views[name].copy_(codes)
                views[f"{name}_scale"].copy_(scales)
            else:
                views[name].copy_(row)

    def kernel(self, *, seed: int, **hyper: object) -> StateKernel:
        return StateKernel(self.state, seed=seed, **hyper)

    def step(self, kernels: UnitKernels, tile: torch.Tensor, values: torch.Tensor,
             grad: GradPieces, start: int, index: int) -> None:
        """One fused call per weight decay range (one for the whole tile without client
        parameter groups); for 8-bit moments a range must start and end on the tile's blocks
        (SwappedOptimizer.set_weight_decay checks)."""
        layout = self.layout(values.numel())
        views = layout.views(tile)
        own = self.values_dtype == torch.float32  # the values are the master
        for lo, hi, kernel in kernels.ranges(start, start + values.numel()):
            at = slice(lo - start, hi - start)
            state = layout.segment(views, at.start, at.stop, master=values[at] if own else None)
            pieces = [g for _, g in grad.ranges(lo, hi)]
            kernel(state, pieces, None if own else values[at], index=index + at.start)
        increment_version(values)


MASTER_AND_MOMENTS = TileFormat(("master", "exp_avg", "exp_avg_sq"))
MOMENTS = TileFormat(("exp_avg", "exp_avg_sq"))
STATE_ROWS = MASTER_AND_MOMENTS.rows  # what iter_state yields and load_state takes, per unit


def format_for(dtype: torch.dtype, state: StateFormat | None = None) -> TileFormat:
    """A float32 unit's values entry is its master: in the default format its tiles hold the
    moments (8 B/element); a bf16/fp16 unit's hold an fp32 master too (12 B/element). Any
    other state format is packed (float32 units with fp32 moments have nothing to pack)."""
    if state is None or state.is_default or (dtype == torch.float32 and state.moments == "fp32"):
        return MOMENTS if dtype == torch.float32 else MASTER_AND_MOMENTS
    return PackedTileFormat(state, dtype)
