"""Write a checkpoint as `save_pretrained` lays it out (`model-0000i-of-0000N.safetensors` +
`model.safetensors.index.json`), one tensor at a time: the shards are planned from the specs
before any value exists, each shard's header is written first, then each tensor's bytes as the
caller produces them, so at most one tensor is held (`safetensors.save_file` needs a whole
shard in memory).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
from collections.abc import Iterator, Sequence

import torch

from infinity.models._safetensors import INDEX_FILE, dtype_name
from infinity.paths import naming

Spec = tuple[str, torch.Size, torch.dtype]  # name, shape, dtype


def plan_shards(specs: Sequence[Spec], max_shard_bytes: int) -> list[list[Spec]]:
    """`specs` in order, cut into shards of at most `max_shard_bytes` (a larger tensor alone)."""
    shards: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * spec[2].itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def write_shards(directory: str | os.PathLike[str], specs: Sequence[Spec],
                 tensors: Iterator[tuple[str, torch.Tensor]], *, max_shard_bytes: int) -> list[pathlib.Path]:
    """Write `tensors` (name, values), which must come in the order, shapes and dtypes of
    `specs`, into shards of at most `max_shard_bytes` plus the index; returns the files."""
    directory = pathlib.Path(directory)
    shards = plan_shards(specs, max_shard_bytes)
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        path = directory / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        with naming(path):
            _write_shard(path, shard, tensors)
        weight_map.update((name, path.name) for name, _, _ in shard)
        files.append(path)
    total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in specs)
    index = directory / INDEX_FILE
    text = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    with naming(index):
        index.write_text(text)
    return files + [index]


def _write_shard(path: pathlib.Path, shard: list[Spec], tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype in shard:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the format asks
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for want, shape, dtype in shard:
            name, values = next(tensors)
            if (name, values.shape, values.dtype) != (want, torch.Size(shape), dtype):
                raise RuntimeError(f"{path}: got tensor {name!r} {tuple(values.shape)} {values.dtype} where the "
                                   f"plan has {want!r} {tuple(shape)} {dtype}")
            f.write(values.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del values  # released before the next tensor is made
