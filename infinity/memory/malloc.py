"""glibc malloc's mmap threshold, which decides whether freed tensors go back to the OS.

glibc serves an allocation below its mmap threshold from its heap. The threshold starts at
128 KiB and rises (up to 32 MiB) each time a larger mapped block is freed, so once a model's
initial weights are freed, most gradient and activation tensors come from the heap, where
training's mix of sizes fragments it and freed memory stays resident. Measured on bench_step's
294M-parameter GPT (params and optimizer on NVMe): peak RSS 3.57-3.61 GB with glibc's dynamic
threshold, 2.84-2.85 GB with a fixed 1 MiB one, at the same CPU time per step (4.59-4.70 s vs
4.70-4.90 s user+sys, within noise; docs/performance.md). A fixed threshold also stops the
rise, so every allocation at or above it has its own mapping, returned to the OS when freed.
The engine fixes 8 MiB where something lives on NVMe (`infinity.mmap_threshold` "auto"): at
1 MiB every activation of a step was a fresh mapping faulted in page by page, ~10% of the
294M GPT's step's CPU once huge pages served the larger tensors (docs/performance.md). A model
that computes in fp32 (fp32 parameters, or bf16 ones upcast on a CPU without bf16 units) gets
32 MiB instead: its weight gradients and upcast parameters are twice the bytes (16 MiB for the
294M GPT's MLP matrices), and above the threshold each was a new mapping whose huge pages the
kernel zeroed afresh: 500-970 of them a step, 17% of the (int8, none) step's CPU on an AVX2
machine (perf), 90-240 at 32 MiB (docs/performance.md "The mmap threshold at 32 MiB where the
model computes in fp32").
"""

from __future__ import annotations

import ctypes
import logging

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MAX_MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)


def set_mmap_threshold(nbytes: int) -> bool:
    """Serve allocations of at least `nbytes` with their own mappings, for the rest of the
    process. Returns False where the C library has no glibc mallopt (then nothing changes)."""
    if not 0 < nbytes <= MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap threshold must be in (0, {MAX_MMAP_THRESHOLD}] bytes, got {nbytes}")
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, int(nbytes)):
        logger.info("malloc: no glibc mallopt here; "
                    "freed memory is returned as the C library decides")
        return False
    logger.debug("malloc: allocations of %d bytes and more are mapped on their own", nbytes)
    return True
