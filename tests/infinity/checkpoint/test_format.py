"""The Infinity checkpoint format: round trips, slices, streaming, and every way a checkpoint can
be wrong (corrupt, truncated, missing, unknown version, not a checkpoint)."""

import json
import math

import pytest
import torch

from infinity.checkpoint import (
    CheckpointReader,
    CheckpointWriter,
    is_infinity_checkpoint,
    latest_tag,
)
from infinity.errors import CheckpointError

TENSORS = {
    "embed.weight": torch.randn(50, 12),
    "layer.0.bias": torch.randn(12).bfloat16(),
    "layer.0.half": torch.randn(7, 3).half(),
    "step": torch.tensor(17),
    "scale": torch.tensor(0.5, dtype=torch.float64),
    "empty": torch.empty(0, 4),
    "mask": torch.rand(9) > 0.5,
    "ids": torch.arange(-300, 300, dtype=torch.int32).reshape(3, 2, 100),
}


def _save(directory, tag="step1", tensors=TENSORS, chunk_nbytes=128, **kwargs):
    with CheckpointWriter(directory, tag, chunk_nbytes=chunk_nbytes, **kwargs) as writer:
        for name, tensor in tensors.items():
            writer.add(name, tensor)
    return writer.path


def test_every_dtype_and_shape_round_trips(tmp_path):
    _save(tmp_path, metadata={"step": 1, "client_state": {"epoch": 2, "order": [3, 1]}})
    reader = CheckpointReader(tmp_path)
    assert reader.names() == list(TENSORS) and reader.tag == "step1"
    assert reader.metadata == {"step": 1, "client_state": {"epoch": 2, "order": [3, 1]}}
    for name, tensor in TENSORS.items():
        got = reader.read(name)
        assert (got.dtype == tensor.dtype and got.shape == tensor.shape
                and torch.equal(got, tensor)), name
    reader.verify()


def test_bf16_is_stored_as_uint16_bits_with_its_logical_dtype(tmp_path):
    tag = _save(tmp_path, tensors={"w": TENSORS["layer.0.bias"]})
    manifest = json.loads((tag / "manifest.json").read_text())
    array = json.loads((tag / manifest["tensors"][0]["array"] / "zarr.json").read_text())
    assert manifest["tensors"][0]["dtype"] == "bfloat16" and array["data_type"] == "uint16"


@pytest.mark.parametrize("rows", [slice(0, 50), slice(3, 4), slice(10, 37), slice(45, 100),
                                  slice(20, 20)])
def test_any_row_slice_reads_alone(tmp_path, rows):
    _save(tmp_path)
    assert torch.equal(CheckpointReader(tmp_path).read("embed.weight", rows),
                       TENSORS["embed.weight"][rows])


@pytest.mark.parametrize("ranks", [1, 2, 3, 7])
def test_any_flat_partition_reads_alone(tmp_path, ranks):
    """ZeRO-3 partitions for any rank count: rank r's elements [r*p, (r+1)*p) of the flat tensor."""
    _save(tmp_path)
    reader = CheckpointReader(tmp_path)
    flat = TENSORS["embed.weight"].reshape(-1)
    p = -(-flat.numel() // ranks)
    parts = [reader.read_flat("embed.weight", min(r * p, flat.numel()),
                              min((r + 1) * p, flat.numel()))
             for r in range(ranks)]
    assert torch.equal(torch.cat(parts), flat)
    with pytest.raises(CheckpointError, match="has 600 elements"):
        reader.read_flat("embed.weight", 590, 601)


def test_read_flat_into_a_given_tensor_converts_chunk_by_chunk(tmp_path):
    """`out=`: the caller's tensor (a view into a larger one, another dtype) receives the elements
    across chunk boundaries; nothing else is touched; a wrong size is refused before reading."""
    _save(tmp_path)
    reader = CheckpointReader(tmp_path)
    flat = TENSORS["embed.weight"].reshape(-1)
    assert reader.entry("embed.weight").chunk_count > 3, "the test needs several chunks"
    into = torch.full((flat.numel() + 10,), -1.0, dtype=torch.float64)
    got = reader.read_flat("embed.weight", 5, 590, out=into[7:592])
    assert got.data_ptr() == into[7:].data_ptr()
    assert torch.equal(into[7:592], flat[5:590].double())
    assert (into[:7] == -1).all() and (into[592:] == -1).all()
    with pytest.raises(ValueError, match="out must be 1-D with 585 elements"):
        reader.read_flat("embed.weight", 5, 590, out=torch.empty(584))


def test_a_slice_reads_only_its_chunks(tmp_path):
    """Damage outside the slice does not matter: only the chunks holding the rows are read."""
    tag = _save(tmp_path)
    reader = CheckpointReader(tmp_path)
    entry = reader.entry("embed.weight")
    assert entry.chunk_count > 3, "the test needs several chunks"
    entry.chunk_file(tag, entry.chunk_count - 1).write_bytes(b"garbage")
    assert torch.equal(reader.read("embed.weight", slice(0, entry.chunk_rows)),
                       TENSORS["embed.weight"][:entry.chunk_rows])


def test_a_tensor_streams_in_as_pieces_of_any_size(tmp_path):
    big = torch.randn(33, 10)
    with CheckpointWriter(tmp_path, "t", chunk_nbytes=200) as writer:
        sink = writer.open_tensor("big", big.shape, big.dtype)
        flat = big.reshape(-1)
        for start, stop in [(0, 1), (1, 120), (120, 121), (121, 330)]:
            sink.write(flat[start:stop])
        sink.close()
    reader = CheckpointReader(tmp_path)
    assert torch.equal(reader.read("big"), big)
    assert [c.numel() for c in reader.iter_chunks("big")] == [50] * 6 + [30]


def test_a_sink_refuses_too_few_too_many_or_wrong_dtype_elements(tmp_path):
    writer = CheckpointWriter(tmp_path, "t")
    sink = writer.open_tensor("w", (4,), torch.float32)
    with pytest.raises(CheckpointError, match="'w' is float32, got a torch.float16"):
        sink.write(torch.zeros(2, dtype=torch.float16))
    with pytest.raises(CheckpointError, match="exceed"):
        sink.write(torch.zeros(5))
    sink.write(torch.zeros(3))
    with pytest.raises(CheckpointError, match="got 0 of its 4 elements"):
        sink.close()
    with pytest.raises(CheckpointError, match=r"\['w'\] .* not closed"):
        writer.commit()
    writer.abort()
    assert list(tmp_path.iterdir()) == []


def test_an_exception_inside_the_block_leaves_nothing(tmp_path):
    _save(tmp_path, "step1")
    with pytest.raises(RuntimeError), CheckpointWriter(tmp_path, "step2") as writer:
        writer.add("w", torch.ones(3))
        raise RuntimeError("training died")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step1"]
    assert latest_tag(tmp_path) == "step1"


def test_an_existing_tag_is_refused(tmp_path):
    _save(tmp_path, "step1")
    with pytest.raises(CheckpointError, match="step1 exists"):
        CheckpointWriter(tmp_path, "step1")


@pytest.mark.parametrize("tag", ["", "latest", "a/b", ".hidden", ".."])
def test_a_tag_that_cannot_name_a_directory_is_refused(tmp_path, tag):
    with pytest.raises(CheckpointError, match="cannot name a directory"):
        CheckpointWriter(tmp_path, tag)


def test_metadata_that_is_not_json_is_refused_at_commit(tmp_path):
    writer = CheckpointWriter(tmp_path, "t", metadata={"rng": torch.ones(2)})
    with pytest.raises(CheckpointError, match="metadata must be JSON"):
        writer.commit()
    writer.abort()


def test_latest_follows_the_newest_commit_and_tags_stay_readable(tmp_path):
    _save(tmp_path, "step1", tensors={"w": torch.ones(3)})
    _save(tmp_path, "step2", tensors={"w": torch.full((3,), 2.0)})
    assert latest_tag(tmp_path) == "step2"
    assert CheckpointReader(tmp_path).read("w").tolist() == [2.0] * 3
    assert CheckpointReader(tmp_path, "step1").read("w").tolist() == [1.0] * 3
    assert CheckpointReader(tmp_path / "step1").tag == "step1"
    _save(tmp_path, "side", tensors={"w": torch.zeros(1)}, update_latest=False)
    assert latest_tag(tmp_path) == "step2"


def _damage_one_chunk(tag, how):
    reader = CheckpointReader(tag)
    entry = reader.entry("embed.weight")
    path = entry.chunk_file(tag, 2)
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) // 2] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[:-6]))
    else:
        path.unlink()
    return path


@pytest.mark.parametrize("how, complaint", [("flip", "does not match its checksum"),
                                            ("truncate", "damaged or truncated"),
                                            ("missing", "is missing")])
def test_a_damaged_chunk_is_an_error_naming_tensor_and_file(tmp_path, how, complaint):
    tag = _save(tmp_path)
    path = _damage_one_chunk(tag, how)
    reader = CheckpointReader(tmp_path)
    for read in (lambda: reader.read("embed.weight"), reader.verify,
                 lambda: reader.read("embed.weight",
                                     slice(2 * reader.entry("embed.weight").chunk_rows, None))):
        with pytest.raises(CheckpointError, match=complaint) as info:
            read()
        assert "'embed.weight'" in str(info.value) and str(path) in str(info.value)
    assert torch.equal(reader.read("ids"), TENSORS["ids"]), "undamaged tensors still read"


def test_an_unknown_format_version_is_a_clear_error(tmp_path):
    tag = _save(tmp_path)
    manifest = json.loads((tag / "manifest.json").read_text())
    manifest["version"] = 99
    (tag / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="format version 99; this Infinity reads version 1"):
        CheckpointReader(tmp_path)


@pytest.mark.parametrize("content", ["not json", json.dumps({"format": "other"}),
                                     json.dumps({"format": "infinity-checkpoint", "version": 1})])
def test_a_damaged_manifest_is_a_clear_error(tmp_path, content):
    tag = _save(tmp_path)
    (tag / "manifest.json").write_text(content)
    with pytest.raises(CheckpointError, match="manifest"):
        CheckpointReader(tmp_path)


def test_a_directory_that_is_no_checkpoint_is_refused(tmp_path):
    (tmp_path / "model.bin").write_bytes(b"x")
    assert not is_infinity_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not an Infinity checkpoint"):
        CheckpointReader(tmp_path)
    (tmp_path / "latest").write_text("gone\n")
    with pytest.raises(CheckpointError, match="manifest.json is missing"):
        CheckpointReader(tmp_path)


def test_chunks_are_bounded_by_chunk_nbytes(tmp_path):
    _save(tmp_path, tensors={"w": torch.zeros(1000, 3)}, chunk_nbytes=1200)
    entry = CheckpointReader(tmp_path).entry("w")
    assert entry.chunk_rows == 100 and entry.chunk_count == 10 and len(entry.crc32c) == 10
    assert math.prod(entry.shape) == 3000
