"""One aligned allocation that an arena or a buffer pool carves up.

Host memory is taken from torch's allocator slightly larger than asked and an aligned view is kept,
so the first byte sits on a page (4 KiB) boundary; that is what O_DIRECT I/O and
``cudaHostRegister`` want. When CUDA is present and pinning is asked for, the aligned range is
registered with ``cudaHostRegister`` (not ``pin_memory=True``, whose caching allocator rounds
sizes up to a power of two) so host-to-device copies from it can be asynchronous.

A device backing is a plain CUDA tensor, over-allocated and aligned the same way.

The backing is released by :meth:`Backing.close`; a finalizer unregisters pinned memory as a
backstop when an owner is dropped without closing, because freeing registered memory leaks the
registration.
"""

from __future__ import annotations

import logging
import weakref

import torch

from aio.buffers import PAGE_NBYTES, aligned_empty  # the page: what O_DIRECT and registration want

logger = logging.getLogger(__name__)



def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, ...; used to validate alignments."""
    return n > 0 and n & (n - 1) == 0


def round_up(n: int, alignment: int) -> int:
    """Smallest multiple of ``alignment`` (a power of two) that is ``>= n``."""
    return (n + alignment - 1) & ~(alignment - 1)


def resolve_device(device: str | torch.device) -> torch.device:
    """Turn ``device`` into a ``torch.device``, naming it when it is neither cpu nor cuda."""
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={str(device)!r} is not supported; use 'cpu' or 'cuda[:N]'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={str(device)!r} asked for, but CUDA is not available")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class Backing:
    """An aligned 1-D uint8 tensor of ``nbytes`` bytes, optionally pinned, freed by ``close``.

    Attributes:
        tensor: the aligned bytes (1D, uint8, ``data_ptr() % alignment == 0``).
        pinned: whether the range is registered with CUDA (only ever true for host memory).
    """

    __slots__ = ("tensor", "pinned", "_finalizer", "__weakref__")

    def __init__(
        self, nbytes: int, device: torch.device, *, pinned: bool, alignment: int = PAGE_NBYTES
    ) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes={nbytes} must be >= 0")
        if not is_power_of_two(alignment):
            raise ValueError(f"alignment={alignment} must be a power of two")
        alignment = max(alignment, PAGE_NBYTES)
        if device.type == "cpu":
            # Huge pages where possible, so direct I/O from and to the arena reaches the disk
            # in large requests: see [Note: physically contiguous buffers] in aio/buffers.py.
            self.tensor: torch.Tensor = aligned_empty(nbytes, alignment, pin=False)
        else:
            # Over-allocate by one alignment unit and slice, because torch only promises 64 bytes.
            raw = torch.empty(nbytes + alignment, dtype=torch.uint8, device=device)
            skip = (-raw.data_ptr()) % alignment
            self.tensor = raw[skip : skip + nbytes]  # 1D, aligned; shares raw's storage
        if device.type == "cpu":
            # Touch every page now: the memory is the OS's to refuse at start-up, never mid-step.
            self.tensor.zero_()
        self.pinned: bool = False
        self._finalizer: weakref.finalize | None = None
        if pinned and device.type == "cpu" and torch.cuda.is_available() and nbytes > 0:
            self._register(nbytes)
        logger.debug(
            "backing of %d bytes on %s at %#x (pinned=%s)",
            nbytes,
            device,
            self.tensor.data_ptr(),
            self.pinned,
        )

    def _register(self, nbytes: int) -> None:
        ptr = self.tensor.data_ptr()
        flags = 1  # cudaHostRegisterPortable: usable from every CUDA context
        ret = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, flags))
        if ret != 0:
            raise RuntimeError(
                f"cudaHostRegister of {nbytes} bytes at {ptr:#x} failed: "
                f"{torch.cuda.CudaError(ret)}; check `ulimit -l` or pass pinned=False"
            )
        self.pinned = True
        # The finalizer holds the tensor, so the memory outlives its registration.
        self._finalizer = weakref.finalize(self, _release_pinned, ptr, self.tensor)

    def close(self) -> None:
        """Unregister the memory if pinned; it is freed once no view of it remains."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.pinned = False


def _release_pinned(ptr: int, keep_alive: torch.Tensor) -> None:
    """Unregister ``ptr``; ``keep_alive`` ties the memory's lifetime to the registration's."""
    ret = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if ret != 0:
        logger.warning("cudaHostUnregister(%#x) failed: %s", ptr, torch.cuda.CudaError(ret))
