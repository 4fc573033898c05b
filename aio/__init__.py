"""aio: asynchronous file I/O for tensors and buffers (kernel AIO, io_uring or threads)."""

from aio._files import direct_io_supported
from aio.buffers import aligned_empty
from aio.checksum import crc32c, crc32c_hardware_available
from aio.errors import AIOError, AIOTimeoutError
from aio.faults import Fault
from aio.free_list import FreeList
from aio.handle import Handle, available_backends
from aio.request import Request
from aio.swap_file import Extent, SwapFile

__all__ = [
    "AIOError",
    "AIOTimeoutError",
    "Extent",
    "Fault",
    "FreeList",
    "Handle",
    "Request",
    "SwapFile",
    "aligned_empty",
    "available_backends",
    "crc32c",
    "crc32c_hardware_available",
    "direct_io_supported",
]
