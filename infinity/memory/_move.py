"""Slide bytes toward lower addresses inside one buffer, correct when source and target overlap.

Compaction moves a live block from ``src`` down to ``dst < src``; when the block is longer than
the gap ``src - dst`` the two ranges overlap. ``Tensor.copy_`` refuses overlapping views (it
raises rather than guess), and CUDA's copies are undefined for them, so the move is split:

- on the host, a move or a gap under ``DIRECT_MIN_NBYTES``: libc ``memmove`` through ctypes
  (overlap-safe, releases the GIL, and has no thread start-up, which dominates small copies
  when the cores are shared);
- no overlap (gap >= nbytes): one ``copy_``;
- gap >= ``DIRECT_MIN_NBYTES``: copy in pieces of ``gap`` bytes, lowest first. Piece k lands on
  bytes that pieces before it have already read, so no piece overlaps its own target, and each
  piece is one large ``copy_`` (threaded on the host, one kernel on the device);
- smaller gap on the device: bounce through a scratch buffer, ``scratch`` bytes at a time (two
  copies per byte, but small gaps only happen for the first blocks of a compaction).

All copies on the device are issued on the current stream, so later work on that stream sees
the moved bytes without a synchronisation.
"""

from __future__ import annotations

import ctypes

import torch

DIRECT_MIN_NBYTES = 1 << 20


def move_down(
    base: torch.Tensor, dst: int, src: int, nbytes: int, scratch: torch.Tensor | None
) -> None:
    """Move ``base[src:src+nbytes]`` to ``base[dst:dst+nbytes]`` with ``dst <= src``.

    ``base`` is a contiguous 1-D uint8 tensor; ``scratch`` (1-D uint8, same device) is needed
    only for device buffers and may be None on the host.
    """
    gap = src - dst
    if gap == 0 or nbytes == 0:
        return
    if base.device.type == "cpu" and min(gap, nbytes) < DIRECT_MIN_NBYTES:
        ptr = base.data_ptr()
        ctypes.memmove(ptr + dst, ptr + src, nbytes)
    elif gap >= nbytes:
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
