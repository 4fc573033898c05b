"""CRC-32C (Castagnoli) of host memory, in native code: checksums for data that leaves RAM.

The SSE4.2 `crc32` instruction is used where the CPU has it (about 10 GB/s per core, see
docs/performance.md), else a portable table (about 1 GB/s). The GIL is released while it runs,
so several threads can checksum at once.
"""

from __future__ import annotations

from typing import Any

from aio import _native
from aio.buffers import raw_buffer

IMPLEMENTATIONS = ("auto", "hardware", "portable")


def crc32c(buffer: Any, crc: int = 0, *, implementation: str = "auto") -> int:
    """The CRC-32C of `buffer`'s bytes, continuing from `crc` (0 to start).

    `buffer` is a contiguous CPU torch.Tensor (any dtype), a C-contiguous numpy.ndarray or a
    buffer-protocol object (bytes, bytearray, memoryview, mmap); its bytes are read as they lie
    in memory. Chaining holds: crc32c(b, crc32c(a)) == crc32c(a + b). `implementation` is
    "auto" (hardware where available), "hardware" (OSError ENOTSUP on a CPU without SSE4.2) or
    "portable"; all give the same value. Raises TypeError for memory the CPU cannot address and
    ValueError for non-contiguous memory or a crc outside 0..2**32-1.
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}, got {implementation!r}")
    if not isinstance(crc, int) or not 0 <= crc < 1 << 32:
        raise ValueError(f"crc must be an int in 0..2**32-1, got {crc!r}")
    raw = raw_buffer(buffer, writable=False)
    # raw keeps the memory alive
    return _native.crc32c(raw.address, raw.nbytes, crc, implementation)


def crc32c_hardware_available() -> bool:
    """Whether implementation="hardware" works on this CPU (x86-64 with SSE4.2)."""
    return _native.crc32c_hardware_available()
