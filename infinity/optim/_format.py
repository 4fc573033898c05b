"""How Adam's state is stored per element: the format record and the byte layout of a tile.

[Note: tile layout] A tile holds the state of `numel` consecutive elements as one flat byte
buffer (a uint8 store entry): its rows one after the other, each starting at a multiple of 64
bytes (a cache line, and aligned for every element type), in this order:

    master            float32 x numel     only when the tile keeps an fp32 master
    exp_avg           moments dtype x numel  (float32, bfloat16 or uint8 codes)
    exp_avg_sq        moments dtype x numel
    exp_avg_scale     float32 x blocks    8-bit moments only: blocks = ceil(numel / block)
    exp_avg_sq_scale  float32 x blocks

All zero bytes are Adam's initial state in every format (zero moments, scales 0). For 8-bit
moments, block b covers tile elements [b * block, (b + 1) * block): a segment handed to the
kernel starts on a block boundary of its tile, so the tile is cut the same way whoever steps
it (see `TileLayout.segment`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from infinity.optim._quant import DEFAULT_BLOCK, block_count

MOMENTS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
MASTERS = ("fp32", "none")
LOWP = (torch.bfloat16, torch.float16)
ROW_ALIGN = 64  # bytes; every row of a tile starts at a multiple of it
BLOCK_LIMITS = (64, 4096)  # INF_ADAM_BLOCK_MIN / _MAX in csrc/adam/inf_adam.h


@dataclass(frozen=True, slots=True)
class StateFormat:
    """What the swapped optimizer keeps per parameter element.

    Attributes:
        moments: "fp32" (4 + 4 bytes: today's state), "bf16" (2 + 2: moments rounded to
            nearest) or "int8" (1 + 1 plus a float32 scale per `block` elements each: codes of
            [Note: 8-bit moments] in infinity/optim/_quant.py).
        master: "fp32" (a float32 copy of 16-bit parameters, 4 bytes) or "none" (16-bit
            parameters are updated in place with stochastic rounding). Moot for float32
            parameters, which are their own master.
        block: elements per 8-bit block: a multiple of 64 in [64, 4096]; moot otherwise.
    """

    moments: str = "fp32"
    master: str = "fp32"
    block: int = DEFAULT_BLOCK

    def __post_init__(self) -> None:
        if self.moments not in MOMENTS:
            raise ValueError(f"moments={self.moments!r} is not one of {sorted(MOMENTS)}")
        if self.master not in MASTERS:
            raise ValueError(f"master={self.master!r} is not one of {list(MASTERS)}")
        lo, hi = BLOCK_LIMITS
        if (isinstance(self.block, bool) or not isinstance(self.block, int)
                or not lo <= self.block <= hi or self.block % 64):
            raise ValueError(f"block={self.block!r} must be a multiple of 64 in [{lo}, {hi}]")

    @property
    def is_default(self) -> bool:
        """Today's format: fp32 moments and master, stepped by `AdamKernel` bit for bit."""
        return self.moments == "fp32" and self.master == "fp32"

    @property
    def moment_dtype(self) -> torch.dtype:
        return MOMENTS[self.moments]

    @property
    def quantized(self) -> bool:
        return self.moments == "int8"

    def keeps_master(self, values_dtype: torch.dtype) -> bool:
        """Whether tiles of parameters of values_dtype hold an fp32 master row (float32
        parameters are their own master; 16-bit ones have one unless master is "none")."""
        if values_dtype == torch.float32:
            return False
        if values_dtype not in LOWP:
            raise TypeError(f"parameters must be float32, bfloat16 or float16, got {values_dtype}")
        return self.master == "fp32"

    def layout(self, numel: int, values_dtype: torch.dtype) -> TileLayout:
        """The byte layout of a tile of numel elements of parameters of values_dtype."""
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be an int >= 0, got {numel!r}")
        rows: list[Row] = []
        offset = 0

        def add(name: str, dtype: torch.dtype, count: int) -> None:
            nonlocal offset
            rows.append(Row(name, dtype, offset, count))
            offset += -(-count * dtype.itemsize // ROW_ALIGN) * ROW_ALIGN

        if self.keeps_master(values_dtype):
            add("master", torch.float32, numel)
        add("exp_avg", self.moment_dtype, numel)
        add("exp_avg_sq", self.moment_dtype, numel)
        if self.quantized:
            blocks = block_count(numel, self.block)
            add("exp_avg_scale", torch.float32, blocks)
            add("exp_avg_sq_scale", torch.float32, blocks)
        return TileLayout(self, numel, offset, tuple(rows))

    def bytes_per_element(self, values_dtype: torch.dtype) -> float:
        """State bytes per parameter element, scales included (not the parameters' values)."""
        master = 4 if self.keeps_master(values_dtype) else 0
        scales = 2 * 4 / self.block if self.quantized else 0.0
        return master + 2 * self.moment_dtype.itemsize + scales


class Row(NamedTuple):
    """One row of a tile: `count` elements of `dtype` from byte `offset`."""

    name: str
    dtype: torch.dtype
    offset: int
    count: int


class SegmentState(NamedTuple):
    """The state tensors of one segment, as the kernel takes them: views into a tile (or, for
    float32 parameters, `master` is the parameters' own values)."""

    master: torch.Tensor | None  # float32, or None without a master
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    exp_avg_scale: torch.Tensor | None = None  # 8-bit moments: one per block
    exp_avg_sq_scale: torch.Tensor | None = None


class TileLayout(NamedTuple):
    """Where each row of a tile lies ([Note: tile layout])."""

    format: StateFormat
    numel: int
    nbytes: int  # bytes of the whole tile
    rows: tuple[Row, ...]

    def views(self, tile: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each row of `tile` (a contiguous uint8 tensor of nbytes) as a typed 1-D view."""
        if tile.dtype != torch.uint8 or tile.dim() != 1 or not tile.is_contiguous():
            raise ValueError(f"a tile is a contiguous 1-D uint8 tensor, got {tile.dtype} "
                             f"{tuple(tile.shape)}")
        if tile.numel() != self.nbytes:
            raise ValueError(f"the tile has {tile.numel()} bytes, its layout {self.nbytes}")
        return {row.name: tile[row.offset:row.offset + row.count * row.dtype.itemsize]
                .view(row.dtype) for row in self.rows}

    def segment(self, views: dict[str, torch.Tensor], start: int, stop: int,
                master: torch.Tensor | None = None) -> SegmentState:
        """The state of tile elements [start, stop): for 8-bit moments start must be a
        multiple of the block (and stop one, or the tile's end), so a block is never shared
        by two segments. `master` stands in for a tile without a master row (the float32
        parameters' values of these elements)."""
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(f"segment [{start}, {stop}) is outside the tile's {self.numel} "
                             "elements")
        block = self.format.block
        if self.format.quantized and (start % block or (stop % block and stop != self.numel)):
            raise ValueError(f"segment [{start}, {stop}) does not start and end on blocks of "
                             f"{block} elements (or the tile's end, {self.numel})")
        if "master" in views and master is not None:
            raise ValueError("the tile has a master row; pass no other master")
        own = views.get("master")
        state = SegmentState(
            master=own[start:stop] if own is not None else master,
            exp_avg=views["exp_avg"][start:stop],
            exp_avg_sq=views["exp_avg_sq"][start:stop],
        )
        if self.format.quantized:
            blocks = slice(start // block, block_count(stop, block))
            state = state._replace(exp_avg_scale=views["exp_avg_scale"][blocks],
                                   exp_avg_sq_scale=views["exp_avg_sq_scale"][blocks])
        return state
