"""Seeded fuzz of handed-in files: random single-bit flips and truncations of a saved Infinity
checkpoint, a safetensors model folder and a DeepSpeed ZeRO-3 checkpoint (100 cases each).
Every case either reads exactly the original tensors or raises CheckpointError: never another
exception type, never a hang (the timeout), never silently different values.

safetensors carries no checksum of its data, so a flipped data byte cannot be noticed by any
reader: its flips go to the headers and the index (truncations go anywhere). Infinity chunks and
DeepSpeed .pt members have checksums (CRC-32C, the zip's CRC-32), so their flips go anywhere.
"""

import random
import struct

import deepspeed_layout
import pytest
import torch

from infinity.checkpoint import CheckpointReader, CheckpointWriter, DeepSpeedReader
from infinity.errors import CheckpointError
from infinity.models._load import _match
from infinity.models._safetensors import ShardReader, index_checkpoint
from infinity.models._writer import write_shards

CASES = 100
SEED = 18


def _flip_or_truncate(rng, path, flip_region=None):
    """Damage `path` in place; returns its original bytes."""
    original = path.read_bytes()
    data = bytearray(original)
    if data and rng.random() < 0.7:
        lo, hi = flip_region(original) if flip_region else (0, len(data))
        data[rng.randrange(lo, hi)] ^= 1 << rng.randrange(8)
    else:
        data = data[:rng.randrange(len(data))] if data else data
    path.write_bytes(bytes(data))
    return original


def _same(got, expected):
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def _fuzz(root, read, files, expected, flip_region=None):
    """CASES damaged copies of `root` (one file at a time, restored after): each `read` gives
    `expected` or raises CheckpointError. Returns how many were refused."""
    rng = random.Random(SEED)
    refused = 0
    for _ in range(CASES):
        path = rng.choice(files)
        original = _flip_or_truncate(rng, path, flip_region(path) if flip_region else None)
        try:
            got = read(root)
        except CheckpointError:
            refused += 1
        else:
            _same(got, expected)
        finally:
            path.write_bytes(original)
    _same(read(root), expected)  # every file is back
    return refused


def _files(root):
    return sorted(p for p in root.rglob("*") if p.is_file())


@pytest.mark.timeout(120)
def test_a_damaged_infinity_checkpoint_reads_exactly_or_is_refused(tmp_path):
    g = torch.Generator().manual_seed(SEED)
    expected = {"model.embed_tokens.weight": torch.randn(40, 8, generator=g),
                "model.norm.weight": torch.randn(8, generator=g).bfloat16(),
                "exp_avg/model.norm.weight": torch.randn(8, generator=g),
                "step": torch.tensor(7)}
    with CheckpointWriter(tmp_path, "step7", metadata={"step": 7}, chunk_nbytes=256) as writer:
        for name, tensor in expected.items():
            writer.add(name, tensor)

    def read(root):
        reader = CheckpointReader(root)
        assert reader.metadata == {"step": 7}
        return {name: reader.read(name) for name in reader.names()}

    refused = _fuzz(tmp_path, read, _files(tmp_path), expected)
    assert refused > CASES // 2  # most damage is noticed; the rest is harmless (a zarr.json field)


@pytest.mark.timeout(120)
def test_a_damaged_deepspeed_checkpoint_reads_exactly_or_is_refused(tmp_path):
    g = torch.Generator().manual_seed(SEED)
    params = {"embed.weight": torch.randn(13, 7, generator=g),
              "fc.bias": torch.randn(5, generator=g)}
    expected = deepspeed_layout.write(tmp_path, params, stage=3, world_size=2,
                                      buffers={"pos": torch.arange(4)})

    def read(root):
        reader = DeepSpeedReader(root)
        return {name: reader.read(name) for name in reader.names()}

    refused = _fuzz(tmp_path, read, _files(tmp_path), expected)
    assert refused > CASES // 2


def _header_region(path):
    """Where flips go in `path`: a safetensors file's length and header, all of the index."""
    if path.suffix != ".safetensors":
        return None
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    return lambda data: (0, 8 + length)


@pytest.mark.timeout(120)
def test_a_damaged_safetensors_model_reads_exactly_or_is_refused(tmp_path):
    model = torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 24),
                                torch.nn.LayerNorm(24), torch.nn.Linear(24, 32))
    g = torch.Generator().manual_seed(SEED)
    weights = {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}
    write_shards(tmp_path, [(n, w.shape, w.dtype) for n, w in weights.items()],
                 iter(weights.items()), max_shard_bytes=2048)
    files = sorted(p for p in tmp_path.iterdir() if p.name.startswith("model"))
    assert len(files) > 3, "the test needs an index and several shards"

    def read(root):
        """What infinity.models.load reads: the index and headers, checked against the model
        (names, shapes, kinds of number), then every tensor's bytes."""
        records = index_checkpoint(str(root))
        _match(model, records, str(root))
        reader, out = ShardReader(), {}
        try:
            for name, record in records.items():
                raw = torch.empty(record.nbytes, dtype=torch.uint8)
                reader.read(record, 0, raw)
                out[name] = raw.view(record.dtype).view(record.shape)
        finally:
            reader.close()
        return out

    refused = _fuzz(tmp_path, read, files, weights, flip_region=_header_region)
    assert refused > CASES // 2
