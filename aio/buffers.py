"""Host buffers for I/O: page-aligned allocation and the raw view of any tensor or array."""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any, NamedTuple

import numpy as np
import torch

logger = logging.getLogger(__name__)

PAGE_NBYTES = max(4096, os.sysconf("SC_PAGE_SIZE"))  # O_DIRECT and SwapFile extents align to it


def _huge_page_nbytes() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 2 << 20


HUGE_PAGE_NBYTES = _huge_page_nbytes()


def aligned_empty(nbytes: int, alignment: int = PAGE_NBYTES, *,
                  pin: bool | None = None) -> torch.Tensor:
    """A 1D torch.uint8 CPU tensor of `nbytes` whose address is a multiple of `alignment`.

    Aligned buffers let O_DIRECT move data without a bounce copy. With CUDA present (or
    pin=True) the memory is page-locked, so copies to the device are asynchronous. The
    returned view keeps its (slightly larger) allocation alive.

    Unpinned buffers of a huge page or more are fresh anonymous memory aligned to and advised
    for transparent huge pages: see [Note: physically contiguous buffers].
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two, got {alignment}")
    if pin is None:
        pin = torch.cuda.is_available()
    if not pin and nbytes >= HUGE_PAGE_NBYTES and alignment <= HUGE_PAGE_NBYTES:
        return _huge_page_backed(nbytes)
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8, pin_memory=pin)
    shift = (-raw.data_ptr()) % alignment
    return raw[shift : shift + nbytes]


# [Note: physically contiguous buffers]
# The block layer turns a direct-I/O piece into device requests of at most max_segments runs
# of physically contiguous memory (254 on virtio disks) and max_sectors_kb bytes. A buffer
# faulted in one 4 KiB page at a time is scattered over physical memory, so a 1 MiB piece
# (256 pages) becomes a request of 1016 KiB plus one of 8 KiB, and adjacent pieces never merge.
# On a virtual disk each request is a round trip to the host: reading TinyLlama-like layers
# into such buffers took 0.70-0.79 s against 0.46 s into huge-page buffers, which reach the
# device as requests of 2.6-3.7 MiB on average (docs/performance.md, "Layer fetch and optimizer
# patterns"; `infinity-nvme-bench --mix`). Huge pages make every 2 MiB of the buffer one
# contiguous run. Where the kernel has no transparent huge pages
# the advice is refused and the buffer is ordinary memory.


def _huge_page_backed(nbytes: int) -> torch.Tensor:
    """`nbytes` of fresh anonymous memory on a huge-page boundary, advised for huge pages."""
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_NBYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError) as exc:  # no THP in this kernel (or this Python)
        logger.debug("huge pages refused (%s); the buffer uses ordinary pages", exc)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # the tensor keeps the mapping alive
    shift = (-raw.data_ptr()) % HUGE_PAGE_NBYTES
    return raw[shift : shift + nbytes]


class RawBuffer(NamedTuple):
    """The memory behind a tensor, array or buffer object."""

    address: int  # first byte
    nbytes: int
    keepalive: Any  # hold this until the I/O completes


def raw_buffer(obj: Any, *, writable: bool) -> RawBuffer:
    """Address and size of a contiguous CPU tensor, ndarray or buffer-protocol object.

    Raises TypeError for memory the CPU cannot address (CUDA, meta) and ValueError for
    non-contiguous or (when `writable`) read-only memory: the engine never copies behind the
    caller's back.
    """
    if isinstance(obj, torch.Tensor):
        if not obj.is_cpu:
            raise TypeError(
                f"I/O needs host memory, got a tensor on {obj.device}; copy it to a host buffer "
                f"first (aio.aligned_empty gives a pinned one)"
            )
        if obj.layout != torch.strided:
            raise TypeError(f"I/O needs a dense tensor, got layout {obj.layout}")
        if not obj.is_contiguous():
            raise ValueError(
                f"I/O needs a contiguous tensor, got shape {tuple(obj.shape)} with strides "
                f"{obj.stride()}; call .contiguous() into a buffer you keep"
            )
        return RawBuffer(obj.data_ptr(), obj.nbytes, obj)
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"I/O needs a C-contiguous array, got strides {obj.strides}")
        if writable and not obj.flags.writeable:
            raise ValueError("cannot read into a read-only array")
        return RawBuffer(obj.__array_interface__["data"][0], obj.nbytes, obj)
    try:
        view = memoryview(obj)
    except TypeError:
        raise TypeError(
            f"I/O needs a torch.Tensor, numpy.ndarray or buffer object, got {type(obj).__name__}"
        ) from None
    if not view.c_contiguous:
        raise ValueError("I/O needs a contiguous buffer")
    if writable and view.readonly:
        raise ValueError(f"cannot read into a read-only {type(obj).__name__}")
    array = np.frombuffer(view, dtype=np.uint8) if view.nbytes else np.empty(0, np.uint8)
    return RawBuffer(array.__array_interface__["data"][0], view.nbytes, (obj, view, array))


def byte_view(obj: Any) -> np.ndarray:
    """A 1D uint8 numpy view of the same memory (for code that needs Python buffers)."""
    buf = raw_buffer(obj, writable=False)
    if isinstance(obj, torch.Tensor):
        return obj.reshape(-1).view(torch.uint8).numpy() if buf.nbytes else np.empty(0, np.uint8)
    if isinstance(obj, np.ndarray):
        return obj.reshape(-1).view(np.uint8)
    return buf.keepalive[2]
