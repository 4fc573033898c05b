"""The one module that touches the compiled engine (`aio._aio_cffi`, built from csrc/aio)."""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from aio._aio_cffi import ffi, lib

BACKEND_IDS = {
    "libaio": lib.INF_AIO_BACKEND_KAIO,
    "io_uring": lib.INF_AIO_BACKEND_URING,
    "threads": lib.INF_AIO_BACKEND_THREADS,
}
OP_IDS = {"read": lib.INF_AIO_OP_READ, "write": lib.INF_AIO_OP_WRITE, "any": -1}
FAULT_IDS = {
    "errno": lib.INF_AIO_FAULT_ERRNO,
    "short": lib.INF_AIO_FAULT_SHORT,
    "hang": lib.INF_AIO_FAULT_HANG,
}


class Status(NamedTuple):
    """What a finished request did (see struct inf_aio_status)."""

    nbytes_done: int  # bytes moved by all pieces together
    error: int  # 0, or the errno of the first piece that failed
    error_offset: int  # file offset where that piece stood
    error_nbytes: int  # bytes that piece still had to move
CRC32C_IDS = {
    "auto": lib.INF_CRC32C_AUTO,
    "portable": lib.INF_CRC32C_PORTABLE,
    "hardware": lib.INF_CRC32C_HARDWARE,
}


def _check(ret: int, what: str) -> int:
    if ret < 0:
        raise OSError(-ret, f"{what}: {os.strerror(-ret)}")
    return ret


def probe(backend: str) -> int:
    """0 when `backend` works in this process, else -errno (e.g. io_uring forbidden)."""
    return lib.inf_aio_backend_probe(BACKEND_IDS[backend])


def dio_alignment(fd: int) -> tuple[int, int] | None:
    """(memory, offset) alignment for O_DIRECT on this file, from statx, or None if unknown."""
    mem = ffi.new("uint32_t *")
    off = ffi.new("uint32_t *")
    if lib.inf_aio_dio_alignment(fd, mem, off) < 0:
        return None
    return mem[0], off[0]


def crc32c(address: int, nbytes: int, crc: int, implementation: str) -> int:
    """CRC-32C of nbytes at address, continuing from crc (the GIL is released meanwhile)."""
    out = ffi.new("uint32_t *")
    _check(lib.inf_crc32c(ffi.cast("void *", address), nbytes, crc, CRC32C_IDS[implementation],
                          out),
           f"crc32c with the {implementation} implementation")
    return out[0]


def crc32c_hardware_available() -> bool:
    return bool(lib.inf_crc32c_hardware_available())


def new_target(direct_fd: int, buffered_fd: int, mem_align: int, direct_align: int) -> Any:
    """A struct inf_aio_target; lives as long as the returned object."""
    return ffi.new(
        "struct inf_aio_target *",
        {
            "direct_fd": direct_fd,
            "buffered_fd": buffered_fd,
            "mem_align": mem_align,
            "direct_align": direct_align,
        },
    )


class NativeHandle:
    """Owns one struct inf_aio_handle; freed by destroy(), never by the garbage collector."""

    def __init__(self, backend: str, block_size: int, queue_depth: int, queues: int) -> None:
        config = ffi.new(
            "struct inf_aio_config *",
            {
                "backend": BACKEND_IDS[backend],
                "block_size": block_size,
                "queue_depth": queue_depth,
                "queues": queues,
            },
        )
        out = ffi.new("struct inf_aio_handle **")
        _check(lib.inf_aio_handle_create(config, out), f"cannot start the {backend} engine")
        self._ptr = out[0]
        self._submitted = ffi.new("struct inf_aio_request **")  # reused: see submit()

    def submit(self, op: str, target: Any, address: int, nbytes: int, offset: int) -> Any:
        """Not thread-safe: the caller serializes submissions (aio.Handle holds its lock)."""
        ret = lib.inf_aio_submit(self._ptr, OP_IDS[op], target, ffi.cast("void *", address),
                                 nbytes, offset, self._submitted)
        if ret < 0:
            raise OSError(-ret, os.strerror(-ret))
        return self._submitted[0]

    def wait(self, request: Any, timeout_ns: int) -> Status | None:
        """The request's status once done, or None if timeout_ns (>= 0) passed first."""
        status = ffi.new("struct inf_aio_status *")
        if lib.inf_aio_wait(self._ptr, request, timeout_ns, status) < 0:
            return None
        return Status(status.nbytes_done, status.error, status.error_offset, status.error_nbytes)

    def done(self, request: Any) -> bool:
        return bool(lib.inf_aio_request_done(self._ptr, request))

    def free(self, request: Any) -> None:
        _check(lib.inf_aio_request_free(self._ptr, request), "request still in flight")

    def add_fault(self, op: str, nth: int, kind: str, value: int) -> None:
        _check(
            lib.inf_aio_fault_add(self._ptr, OP_IDS[op], nth, FAULT_IDS[kind], value),
            "cannot add fault",
        )

    def shutdown(self) -> None:
        lib.inf_aio_handle_shutdown(self._ptr)

    def destroy(self) -> None:
        lib.inf_aio_handle_destroy(self._ptr)
        self._ptr = ffi.NULL
