"""safetensors files written tensor by tensor, piece by piece: the header is known from shapes
and dtypes before any data, so a shard never has to be held in memory.

Format: 8-byte little-endian header length, a JSON header (name -> dtype, shape, data_offsets;
padded with spaces to a multiple of 8), then the tensors' bytes back to back.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from infinity.checkpoint._common import ProgressCallback, dtype_name, to_storage, torch_dtype
from infinity.errors import CheckpointError

_CODES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
          "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_NAMES = {code: name for name, code in _CODES.items()}


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], torch.dtype]],
                      pieces: Callable[[str], Iterator[torch.Tensor]],
                      on_progress: ProgressCallback | None = None) -> None:
    """Write `tensors` (name, shape, dtype) to `path`, each from its flat `pieces(name)`."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in tensors:
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": _CODES[dtype_name(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for name, _, dtype in tensors:
            start = f.tell()
            for piece in pieces(name):
                if piece.dtype != dtype:
                    raise CheckpointError(f"tensor {name!r}: piece of {piece.dtype}, "
                                          f"expected {dtype}")
                data = to_storage(piece)
                f.write(data.reshape(-1).view("u1"))
                if on_progress is not None:
                    on_progress(data.nbytes)
            begin, end = header[name]["data_offsets"]
            if f.tell() - start != end - begin:
                raise CheckpointError(f"tensor {name!r} gave {f.tell() - start} bytes, its shape "
                                      f"needs {end - begin}")


def read_safetensors(path: Path, block_nbytes: int
                     ) -> Iterator[tuple[str, list[int], torch.dtype, Iterator[np.ndarray]]]:
    """(name, shape, dtype, raw byte blocks of at most `block_nbytes`) of every tensor in the
    file at `path`, in file order. The safetensors library opens the file first, so a header it
    would refuse fails here; the bytes are then read block by block, never the whole shard."""
    with safe_open(str(path), framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118 (safe_open is no dict)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        if set(header) != names:
            raise CheckpointError(f"{path}: header names differ from what safetensors reads")
        base = 8 + length
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            begin, end = info["data_offsets"]
            yield (name, info["shape"], torch_dtype(_NAMES[info["dtype"]]),
                   _blocks(f, base + begin, end - begin, block_nbytes))


def _blocks(f, offset: int, nbytes: int, block_nbytes: int) -> Iterator[np.ndarray]:
    f.seek(offset)
    while nbytes > 0:
        block = f.read(min(nbytes, block_nbytes))
        if not block:
            raise CheckpointError(f"{f.name} ends {nbytes} bytes early")
        nbytes -= len(block)
        yield np.frombuffer(block, dtype=np.uint8)
