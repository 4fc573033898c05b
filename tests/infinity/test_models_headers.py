"""Hostile safetensors model folders: every malformed header (the format's rules: a JSON object,
known dtypes, shapes of naturals, byte ranges of shape x dtype tiling the data section) and every
path leading outside the folder is a CheckpointError naming the file and the tensor or entry,
before anything is loaded."""

import json
import os
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch

from infinity.errors import CheckpointError
from infinity.models._safetensors import index_checkpoint, read_header

transformers = pytest.importorskip("transformers")

from test_models import WINDOW, config, saved, tiny_llama  # noqa: E402

import infinity  # noqa: E402

A = {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}
B = {"dtype": "F32", "shape": [3], "data_offsets": [16, 28]}


def _write(path, header, data=bytes(28), *, raw_header=None):
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + data)
    return str(path)


def _entries(**changes):
    return {"__metadata__": {"format": "pt"}, "a": {**A, **changes.get("a", {})},
            "b": {**B, **changes.get("b", {})}}


BAD_ENTRY = "corrupt header entry"
MALFORMED = {  # name: (header, raw header bytes or None, data, tensor named, complaint)
    "a JSON list": ([1, 2], None, bytes(28), None, "a JSON list, not an object"),
    "offset before the data": (_entries(a={"data_offsets": [-8, 8]}), None, bytes(28), "a",
                               "corrupt header entry for tensor 'a'"),
    "past the end": (_entries(b={"shape": [6], "data_offsets": [16, 40]}), None, bytes(28), "b",
                     "truncated: tensor 'b' ends at byte"),
    "overlapping": (_entries(b={"data_offsets": [8, 20]}), None, bytes(28), "b",
                    "overlaps the tensor before it"),
    "a gap": (_entries(b={"data_offsets": [20, 32]}), None, bytes(32), "b",
              "leaves bytes 16-20 unused"),
    "range not shape x dtype": (_entries(a={"data_offsets": [0, 12]}, b={"data_offsets": [12, 24]}),
                                None, bytes(24), "a", "has 12 bytes for shape (2, 2)"),
    "begin after end": (_entries(a={"data_offsets": [16, 0]}), None, bytes(28), "a", BAD_ENTRY),
    "an entry that is no object": ({"a": 5, "b": B}, None, bytes(28), "a", "corrupt header entry"),
    "an unknown dtype": (_entries(a={"dtype": "F8"}), None, bytes(28), "a", "corrupt header entry"),
    "a negative dimension": (_entries(a={"shape": [-2, -2]}), None, bytes(28), "a", BAD_ENTRY),
    "a float dimension": (_entries(a={"shape": [2.0, 2]}), None, bytes(28), "a", BAD_ENTRY),
    "a key twice": (None, b'{"a": %s, "a": %s, "b": %s}' % tuple(
        json.dumps(x).encode() for x in (A, A, B)), bytes(28), None, "the key 'a' appears twice"),
    "metadata not strings": ({**_entries(), "__metadata__": {"format": 1}}, None, bytes(28), None,
                             "__metadata__ must map strings"),
    "trailing bytes": (_entries(), None, bytes(40), None, "12 bytes after the last tensor"),
    "a header not UTF-8": (None, b'{"\xff": 1}', bytes(28), None, "corrupt header"),
    "a header longer than the file": (None, b"{}", b"", None, "corrupt header"),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_header_is_named(tmp_path, case):
    header, raw, data, tensor, complaint = MALFORMED[case]
    path = _write(tmp_path / "model.safetensors", header, data, raw_header=raw)
    if case == "a header longer than the file":
        with open(path, "r+b") as f:
            f.write(struct.pack("<Q", 1 << 20))
    with pytest.raises(CheckpointError, match=re.escape(complaint)) as caught:
        read_header(path)
    assert caught.value.path == path and path in str(caught.value)
    assert caught.value.tensor == tensor
    if tensor is not None:
        assert repr(tensor) in str(caught.value)


def test_a_well_formed_header_reads(tmp_path):
    path = _write(tmp_path / "model.safetensors", _entries())
    records = read_header(path)
    data_start = os.path.getsize(path) - 28
    assert {n: (r.start - data_start, r.nbytes, tuple(r.shape)) for n, r in records.items()} == {
        "a": (0, 16, (2, 2)), "b": (16, 12, (3,))}


def _rewrite_header(path, edit):
    """Apply edit(header) to the safetensors file at `path`, keeping its data."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = f.read()
    edit(header)
    _write(path, header, data)


def _index(directory):
    return os.path.join(directory, "model.safetensors.index.json")


def _weight_map(directory):
    with open(_index(directory)) as f:
        return json.load(f)["weight_map"]


def _set_weight_map(directory, weight_map):
    with open(_index(directory), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


NORM = "model.norm.weight"


def _negative_offset(d):
    path = os.path.join(d, _weight_map(d)[NORM])
    _rewrite_header(path, lambda h: h[NORM].update(data_offsets=[-64, -64 + 128]))
    return path, NORM, "corrupt header entry"


def _header_a_list(d):
    path = os.path.join(d, _weight_map(d)[NORM])
    _write(path, ["not", "a", "header"], b"")
    return path, None, "not an object"


def _int_weights(d):
    path = os.path.join(d, _weight_map(d)[NORM])
    _rewrite_header(path, lambda h: h[NORM].update(dtype="I32"))  # one byte: F -> I
    return path, NORM, "not the same kind of number"


def _index_outside(d):
    elsewhere = os.path.join(os.path.dirname(d), "elsewhere")
    os.makedirs(elsewhere)
    weight_map = _weight_map(d)
    shutil.copy(os.path.join(d, weight_map[NORM]), os.path.join(elsewhere, "x.safetensors"))
    weight_map[NORM] = "../elsewhere/x.safetensors"
    _set_weight_map(d, weight_map)
    return _index(d), None, "'../elsewhere/x.safetensors' leads outside"


@pytest.mark.parametrize("breakage", [_negative_offset, _header_a_list, _int_weights,
                                      _index_outside], ids=lambda f: f.__name__.lstrip("_"))
def test_a_hostile_model_folder_is_refused_before_anything_loads(tmp_path, breakage):
    directory = saved(tmp_path, tiny_llama())
    path, tensor, complaint = breakage(directory)
    with pytest.raises(CheckpointError, match=complaint) as caught:
        infinity.models.load(directory, config(tmp_path), window=WINDOW)
    assert caught.value.path == path and path in str(caught.value)
    if tensor is not None:
        assert caught.value.tensor == tensor and repr(tensor) in str(caught.value)
    assert os.listdir(tmp_path / "swap") == []  # nothing was placed


@pytest.mark.parametrize("entry", ["/abs/x.safetensors", "../elsewhere/x.safetensors",
                                   "a/../../x.safetensors"])
def test_an_index_entry_outside_the_folder_is_named(tmp_path, entry):
    directory = tmp_path / "model"
    directory.mkdir()
    _write(directory / "x.safetensors", _entries())
    _set_weight_map(str(directory), {"a": "x.safetensors", "b": entry})
    with pytest.raises(CheckpointError, match="leads outside|absolute path") as caught:
        index_checkpoint(str(directory))
    assert caught.value.path == _index(str(directory)) and repr(entry) in str(caught.value)


@pytest.mark.parametrize("linked", ["shard", "single file", "index"])
def test_a_symlink_out_of_the_folder_is_refused(tmp_path, linked):
    directory, outside = tmp_path / "model", tmp_path / "outside"
    directory.mkdir()
    outside.mkdir()
    _write(outside / "x.safetensors", _entries())
    if linked == "shard":
        _set_weight_map(str(directory), {"a": "x.safetensors", "b": "x.safetensors"})
        os.symlink(outside / "x.safetensors", directory / "x.safetensors")
    elif linked == "single file":
        os.symlink(outside / "x.safetensors", directory / "model.safetensors")
    else:
        _set_weight_map(str(outside), {"a": "x.safetensors", "b": "x.safetensors"})
        os.symlink(_index(str(outside)), _index(str(directory)))
    with pytest.raises(CheckpointError, match="leads outside"):
        index_checkpoint(str(directory))


def test_a_config_symlinked_out_of_the_folder_is_refused(tmp_path):
    from infinity.models._meta import build_on_meta

    (tmp_path / "model").mkdir()
    tiny_llama().config.save_pretrained(tmp_path)
    os.symlink(tmp_path / "config.json", tmp_path / "model" / "config.json")
    with pytest.raises(CheckpointError, match="'config.json' leads outside"):
        build_on_meta(str(tmp_path / "model"), torch.float32)


def test_a_hub_cache_snapshot_reads_its_blobs(tmp_path):
    """huggingface_hub's cache: snapshots/<rev>/ holds symlinks into the repository's blobs/."""
    repo = tmp_path / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    _write(repo / "blobs" / "f00d", _entries(), bytes(range(28)))
    os.symlink("../../blobs/f00d", snapshot / "model.safetensors")
    records = index_checkpoint(str(snapshot))
    assert sorted(records) == ["a", "b"]
