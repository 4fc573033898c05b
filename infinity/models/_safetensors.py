"""The tensors of a safetensors checkpoint (one file, or shards named by an index) as byte
ranges in their files, read piece by piece with pread into the caller's buffer.

[Note: no mmap] safe_open memory-maps a file; every page a copy touches stays in the process's
resident set (RssFile) until the kernel needs it back, so a load through it peaks at the size of
the checkpoint. pread goes through the page cache, which the process does not own: the peak is
the caller's buffer. The format (8-byte little-endian header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the data) is read here directly.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from infinity.errors import CheckpointError
from infinity.paths import inside

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
           "U8": torch.uint8, "BOOL": torch.bool}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
_MAX_HEADER = 100 << 20  # as the safetensors library: a larger header is a corrupt file


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """Where one tensor's bytes are."""

    name: str
    path: str  # file holding it
    dtype: torch.dtype
    shape: torch.Size
    start: int  # byte offset of its first element in the file
    nbytes: int

    @property
    def numel(self) -> int:
        return self.shape.numel()


def dtype_name(dtype: torch.dtype) -> str:
    """The format's name of `dtype` ("BF16", ...); ValueError for one it cannot hold."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"safetensors has no dtype {dtype}") from None


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """json object hook: a key given twice (the second would silently win) is an error."""
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        twice = next(k for k in keys if keys.count(k) > 1)
        raise ValueError(f"the key {twice!r} appears twice")
    return dict(pairs)


def _natural(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_header(path: str) -> dict[str, TensorRecord]:
    """The tensors of one safetensors file, checked by the format's rules before anything is
    read: a JSON object header (no key twice; `__metadata__` strings only), each entry a known
    dtype, a shape of naturals and data_offsets [begin, end] whose length is shape x dtype, and
    the ranges tiling the data section exactly (no overlap, no gap, nothing before or past it).
    CheckpointError naming the file (and the tensor) otherwise."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: truncated ({size} bytes, not even a header length)", path=path)
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER or 8 + length > size:
                raise CheckpointError(f"{path}: truncated or corrupt: header of {length} bytes in a file of "
                                      f"{size} bytes", path=path)
            header = json.loads(f.read(length), object_pairs_hook=_no_duplicates)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot be read: {exc.strerror}", path=path) from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise CheckpointError(f"{path}: corrupt header ({exc})", path=path) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt header (a JSON {type(header).__name__}, not an "
                              f"object)", path=path)
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: corrupt header (__metadata__ must map strings to "
                              f"strings)", path=path)
    records = {}
    for name, info in header.items():
        try:
            dtype = _DTYPES[info["dtype"]]
            shape, offsets = info["shape"], info["data_offsets"]
            if not isinstance(shape, list) or not all(_natural(d) for d in shape):
                raise TypeError
            begin, end = offsets
            if not (_natural(begin) and _natural(end) and begin <= end):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt header entry for tensor {name!r}: "
                                  f"{info!r:.200}", path=path, tensor=name) from None
        shape = torch.Size(shape)
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise CheckpointError(f"{path}: tensor {name!r} has {end - begin} bytes for shape {tuple(shape)} "
                                  f"{dtype} ({nbytes} bytes)", path=path, tensor=name)
        records[name] = TensorRecord(name, path, dtype, shape, 8 + length + begin, nbytes)
    _check_tiling(path, records, size - 8 - length, 8 + length)
    return records


def _check_tiling(path: str, records: dict[str, TensorRecord], data_nbytes: int, base: int) -> None:
    """The tensors' byte ranges cover the data section exactly once."""
    at = 0
    for record in sorted(records.values(), key=lambda r: (r.start, r.nbytes)):
        begin, end = record.start - base, record.start - base + record.nbytes
        if begin != at:
            what = ("overlaps the tensor before it" if begin < at
                    else f"leaves bytes {at}-{begin} unused")
            raise CheckpointError(f"{path}: tensor {record.name!r} (data bytes {begin}-{end}) "
                                  f"{what}: corrupt header", path=path, tensor=record.name)
        if end > data_nbytes:
            raise CheckpointError(f"{path}: truncated: tensor {record.name!r} ends at byte "
                                  f"{base + end}, the file has {base + data_nbytes}",
                                  path=path, tensor=record.name)
        at = end
    if at != data_nbytes:
        raise CheckpointError(f"{path}: {data_nbytes - at} bytes after the last tensor's data: "
                              f"corrupt header (the tensors must cover the data section)",
                              path=path)


def index_checkpoint(directory: str) -> dict[str, TensorRecord]:
    """Every tensor of the checkpoint in `directory` (model.safetensors, or the shards its
    index names), checked: each shard inside `directory`, present and whole, each indexed
    tensor in its shard."""
    index_path = os.path.join(directory, INDEX_FILE)
    single = os.path.join(directory, SINGLE_FILE)
    if not os.path.exists(index_path):
        if not os.path.exists(single):
            raise CheckpointError(f"{directory}: no {SINGLE_FILE} nor {INDEX_FILE} (only local safetensors "
                                  "checkpoints are read)", path=directory)
        return read_header(os.fspath(inside(directory, SINGLE_FILE, source=directory)))
    inside(directory, INDEX_FILE, source=directory)
    try:
        with open(index_path, "rb") as f:
            weight_map = json.load(f, object_pairs_hook=_no_duplicates)["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except OSError as exc:
        raise CheckpointError(f"{index_path}: cannot be read: {exc.strerror}", path=index_path) from None
    except (ValueError, KeyError, TypeError, RecursionError):
        raise CheckpointError(f"{index_path}: corrupt index (no weight_map object)", path=index_path) from None
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        if not isinstance(file, str):
            raise CheckpointError(f"{index_path}: tensor {name!r} maps to {file!r}, not a file "
                                  f"name", path=index_path, tensor=name)
        by_file.setdefault(file, []).append(name)
    records: dict[str, TensorRecord] = {}
    for file, names in by_file.items():
        path = os.fspath(inside(directory, file, source=index_path))
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: shard missing; {INDEX_FILE} names it for {len(names)} tensors "
                                  f"({names[0]!r} first)", path=path, tensor=names[0])
        found = read_header(path)
        for name in names:
            if name not in found:
                raise CheckpointError(f"{path}: tensor {name!r} is not in this shard, but {INDEX_FILE} "
                                      "says it is", path=path, tensor=name)
            records[name] = found[name]
    return records


class ShardReader:
    """Open shard files, read by byte range (one descriptor per file, closed by close())."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}

    def read(self, record: TensorRecord, first: int, out: torch.Tensor) -> None:
        """Fill `out` (a CPU uint8 tensor) with the record's bytes from element `first` on."""
        fd = self._fds.get(record.path)
        if fd is None:
            fd = self._fds[record.path] = os.open(record.path, os.O_RDONLY)
        view = memoryview(out.numpy())
        offset = record.start + first * record.dtype.itemsize
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], offset + done)
            if n == 0:
                raise CheckpointError(f"{record.path}: truncated while reading tensor {record.name!r} (at byte "
                                      f"{offset + done})", path=record.path, tensor=record.name)
            done += n

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
