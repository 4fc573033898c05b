"""Slide bytes toward lower addresses inside one buffer: all the moves of one compaction.

Compaction moves live runs down, in address order; move i copies ``nbytes[i]`` bytes from
``src[i]`` to ``dst[i] <= src[i]``, and its target may overlap its own source and the sources of
earlier moves. Done one after another, each move as a memmove, that is always right.

- On the host every move goes to the native ``inf_move_down_batch`` (csrc/memory, built by
  csrc/build_memory.py) in one call: it releases the GIL, cuts the moves into pieces and copies
  them on up to ``threads`` threads, keeping only the orders that matter (see [Note: only
  write-after-read] in csrc/memory/inf_move.h). This module is the only one that touches it.
- On a device each move is ``copy_down``: ``Tensor.copy_`` refuses overlapping views (it raises
  rather than guess), and CUDA's copies are undefined for them, so an overlapping move is split.
  With no overlap (gap >= nbytes) it is one ``copy_``. With a gap of ``DIRECT_MIN_NBYTES`` or
  more it is copied in pieces of ``gap`` bytes, lowest first: piece k lands on bytes that pieces
  before it have already read, so no piece overlaps its own target, and each piece is one
  kernel. A smaller gap bounces through a scratch buffer, ``scratch`` bytes at a time (two
  copies per byte, but small gaps only happen for the first blocks of a compaction). All copies
  are issued on the current stream, so later work on that stream sees the moved bytes without a
  synchronisation.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from infinity.memory.thread_pool import ThreadPool

_BUILD_HINT = "run `python csrc/build_memory.py` from the repository root, or `pip install -e .`"
try:
    from infinity.memory._move_cffi import ffi, lib
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(f"infinity.memory._move_cffi is not built; {_BUILD_HINT}") from exc

DIRECT_MIN_NBYTES = 1 << 20


def move_down(
    base: torch.Tensor,
    dst: Sequence[int],
    src: Sequence[int],
    nbytes: Sequence[int],
    *,
    scratch: torch.Tensor | None = None,
    threads: int | None = None,
    pool: ThreadPool | None = None,
) -> None:
    """Move ``base[src[i]:src[i]+nbytes[i]]`` to ``base[dst[i]:...]`` for each i, in order.

    ``base`` is a contiguous 1-D uint8 tensor. The moves must have a compaction's shape:
    ``0 <= dst[i] <= src[i]``, and both sources and targets ascend without overlapping one
    another (each may overlap its own source and earlier sources). On the host a move list of
    another shape raises ValueError before anything is copied. The copies run on the calling
    thread and on workers of ``pool`` (none without one), at most ``threads`` in all (default:
    the pool's size). On a device the moves are trusted, and
    ``scratch`` (1-D uint8, same device) is needed for small overlapping gaps.
    """
    if not len(dst) == len(src) == len(nbytes):
        raise ValueError(f"{len(dst)} targets, {len(src)} sources and {len(nbytes)} sizes")
    if base.dtype != torch.uint8 or base.dim() != 1 or not base.is_contiguous():
        raise ValueError(f"base must be a contiguous 1-D uint8 tensor, not {base.dtype} "
                         f"of shape {tuple(base.shape)}")
    if base.device.type != "cpu":
        for at, start, n in zip(dst, src, nbytes, strict=True):
            copy_down(base, at, start, n, scratch)
        return
    if threads is None:
        threads = pool.threads if pool is not None else 1
    ret = lib.inf_move_down_batch(
        ffi.cast("uint8_t *", base.data_ptr()),
        base.numel(),
        ffi.new("int64_t[]", dst),
        ffi.new("int64_t[]", src),
        ffi.new("int64_t[]", nbytes),
        len(dst),
        threads,
        ffi.NULL if pool is None else pool.native,
    )
    if ret < 0:
        raise ValueError(
            f"inf_move_down_batch refused {len(dst)} moves in {base.numel()} bytes on "
            f"{threads} threads ({os.strerror(-ret)}): targets must not be above their sources, "
            "and sources and targets must ascend without overlapping one another"
        )


def copy_down(
    base: torch.Tensor, dst: int, src: int, nbytes: int, scratch: torch.Tensor | None
) -> None:
    """One move with torch copies only (the device path; it runs on the host too)."""
    gap = src - dst
    if gap == 0 or nbytes == 0:
        return
    if gap >= nbytes:
        base[dst : dst + nbytes].copy_(base[src : src + nbytes])
    elif gap >= DIRECT_MIN_NBYTES:
        _copy_in_gap_pieces(base, dst, gap, nbytes)
    else:
        if scratch is None or scratch.numel() == 0:
            raise ValueError(f"moving {nbytes} bytes on {base.device} needs a scratch buffer")
        _bounce(base, dst, src, nbytes, scratch)


def _copy_in_gap_pieces(base: torch.Tensor, dst: int, gap: int, nbytes: int) -> None:
    done = 0
    while done < nbytes:
        n = min(gap, nbytes - done)
        at = dst + done
        base[at : at + n].copy_(base[at + gap : at + gap + n])
        done += n


def _bounce(base: torch.Tensor, dst: int, src: int, nbytes: int, scratch: torch.Tensor) -> None:
    step = scratch.numel()
    done = 0
    while done < nbytes:
        n = min(step, nbytes - done)
        piece = scratch[:n]
        piece.copy_(base[src + done : src + done + n])
        base[dst + done : dst + done + n].copy_(piece)
        done += n
