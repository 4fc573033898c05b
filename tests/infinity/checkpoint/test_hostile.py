"""Handed-in checkpoints as an attacker (or a bad disk) makes them, each through infinity-convert:
no file runs code (no marker file appears), no path taken from a file leads outside its folder,
a damaged manifest or .pt file is refused. Every refusal is one line naming the file, exit 2,
and nothing left beside the output."""

import json
import logging
import os
import shutil
import zipfile

import deepspeed_layout
import hostile
import pytest
import torch

import aio
from infinity.checkpoint import CheckpointReader, CheckpointWriter, DeepSpeedReader
from infinity.cli.convert import main
from infinity.errors import CheckpointError

PARAMS = {"embed.weight": torch.arange(12.0).reshape(4, 3), "fc.weight": torch.arange(6.0)}
WEIGHTS = {"model.embed_tokens.weight": torch.randn(6, 4),
           "model.layers.0.self_attn.q_proj.weight": torch.randn(4, 4),
           "model.layers.1.self_attn.q_proj.weight": torch.randn(4, 4)}


def refused(tmp_path, capsys, src, *complaints, to="safetensors", extra=()):
    """infinity-convert of `src` into tmp_path/out: exit 2, one line holding `complaints`,
    tmp_path as before, no marker file."""
    before = sorted(p.name for p in tmp_path.iterdir())
    code = main([str(src), str(tmp_path / "out"), "--to", to, *extra])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("infinity-convert: error: "), err
    for complaint in complaints:
        assert str(complaint) in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not (tmp_path / "marker").exists()
    return err


# -- files that would run code --
DS_NAMES = {  # every file name the DeepSpeed reader opens -> a layout that has it
    "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": {"stage": 3, "precision": "bf16"},
    "zero_pp_rank_1_mp_rank_00_optim_states.pt": {"stage": 3, "precision": "fp32"},
    "zero_pp_rank_1_mp_rank_00_model_states.pt": {"stage": 3, "precision": "bf16"},
    "mp_rank_00_model_states.pt": {"stage": 2, "precision": "fp16"},
}
WHY = {"torchscript": "is a TorchScript archive", "reduce zip": "asks to load io.open",
       "reduce legacy": "a legacy pickle is refused", "raw pickle": "a legacy pickle is refused"}


@pytest.mark.parametrize("kind", hostile.KINDS)
@pytest.mark.parametrize("name", DS_NAMES)
def test_a_file_that_runs_code_under_any_deepspeed_name_is_refused(tmp_path, capsys, name, kind):
    deepspeed_layout.write(tmp_path / "ds", PARAMS, world_size=2, **DS_NAMES[name])
    path = tmp_path / "ds" / "global_step7" / name
    assert path.is_file()
    hostile.write(kind, path, tmp_path / "marker")
    assert hostile.live(kind, path, tmp_path / "marker"), "the file must be armed"
    refused(tmp_path, capsys, tmp_path / "ds", path, WHY[kind])


class _Calls:
    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize("fn, args, global_name", [
    (eval, ("1",), "builtins.eval"), (torch.load, ("x",), "torch.serialization.load"),
    (shutil.rmtree, ("x",), "shutil.rmtree"), (getattr, (1, "real"), "builtins.getattr"),
])
def test_a_global_outside_the_allow_list_is_refused_by_name(tmp_path, fn, args, global_name):
    deepspeed_layout.write(tmp_path, PARAMS, stage=3, world_size=1)
    path = tmp_path / "global_step7" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": 3, "x": _Calls(fn, *args)}}, path)
    with pytest.raises(CheckpointError, match=f"{path} asks to load {global_name}"):
        DeepSpeedReader(tmp_path)


def test_a_deepspeed_class_is_an_inert_stand_in(tmp_path):
    deepspeed_layout.write(tmp_path, PARAMS, stage=3, world_size=1, precision="fp16")
    reader = DeepSpeedReader(tmp_path)
    assert reader.metadata["loss_scale"] == 2.0 ** 16 and reader.zero_stage == 3
    assert "deepspeed" not in str(type(reader.metadata["loss_scale"]))


# -- damaged .pt files: the zip's own checks --
def _member(path, suffix):
    with zipfile.ZipFile(path) as archive:
        return next(i for i in archive.infolist() if i.filename.endswith(suffix))


def test_a_flipped_byte_in_tensor_data_fails_the_zip_crc(tmp_path, capsys):
    deepspeed_layout.write(tmp_path / "ds", PARAMS, stage=3, world_size=2)
    path = tmp_path / "ds" / "global_step7" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    info = _member(path, "data/0")
    data = bytearray(path.read_bytes())
    local = info.header_offset
    start = local + 30 + int.from_bytes(data[local + 26:local + 28], "little") + \
        int.from_bytes(data[local + 28:local + 30], "little")
    data[start + 1] ^= 0x04
    path.write_bytes(bytes(data))
    refused(tmp_path, capsys, tmp_path / "ds", path, "Bad CRC-32")


@pytest.mark.parametrize("damage, complaint", [
    ("compressed", "is compressed, which torch.save never writes"),
    ("duplicated", "names a member twice"),
])
def test_a_zip_torch_save_never_writes_is_refused(tmp_path, capsys, damage, complaint):
    deepspeed_layout.write(tmp_path / "ds", PARAMS, stage=3, world_size=1)
    path = tmp_path / "ds" / "global_step7" / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    with zipfile.ZipFile(path) as archive:
        members = [(i.filename, archive.read(i)) for i in archive.infolist()]
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members:
            archive.writestr(name, data, zipfile.ZIP_DEFLATED if damage == "compressed"
                             and name.endswith("data.pkl") else zipfile.ZIP_STORED)
        if damage == "duplicated":
            with pytest.warns(UserWarning, match="Duplicate name"):
                archive.writestr(members[0][0], members[0][1])
    refused(tmp_path, capsys, tmp_path / "ds", path, complaint)


# -- paths that lead outside --
def _infinity(directory, tag="step1"):
    with CheckpointWriter(directory, tag) as writer:
        for name, tensor in WEIGHTS.items():
            writer.add(name, tensor)
    return directory / tag


def _edit_manifest(tag, edit, *, sign=True):
    """Change the manifest of `tag`; `sign` recomputes its checksum as an attacker would (else
    it is dropped, as in a manifest written before checksums existed)."""
    path = tag / "manifest.json"
    body = json.loads(path.read_text())
    del body["crc32c"]
    edit(body)
    if sign:
        text = json.dumps(body, sort_keys=True, separators=(",", ":"))
        body["crc32c"] = aio.crc32c(text.encode())
    path.write_text(json.dumps(body))


def _array(body, name):
    return next(t for t in body["tensors"] if t["name"] == name)


@pytest.mark.parametrize("target", ["absolute", "dotdot"])
def test_a_manifest_array_outside_the_tag_is_refused(tmp_path, capsys, target):
    tag = _infinity(tmp_path / "run")
    outside = _infinity(tmp_path / "other") / "arrays" / "0"
    entry = str(outside) if target == "absolute" else "../../other/step1/arrays/0"
    _edit_manifest(tag, lambda body: _array(body, "model.embed_tokens.weight").update(array=entry))
    refused(tmp_path, capsys, tmp_path / "run", tag / "manifest.json", repr(entry))


def test_a_symlink_leading_outside_is_refused(tmp_path, capsys):
    tag = _infinity(tmp_path / "run")
    other = _infinity(tmp_path / "other")
    shutil.rmtree(tag / "arrays" / "1")
    os.symlink(other / "arrays" / "1", tag / "arrays" / "1")  # an array directory
    refused(tmp_path, capsys, tmp_path / "run", tag / "manifest.json", "'arrays/1' leads outside")
    shutil.rmtree(tag)
    os.symlink(other, tag)  # the tag directory `latest` names
    refused(tmp_path, capsys, tmp_path / "run", tmp_path / "run" / "latest",
            "'step1' leads outside")


@pytest.mark.parametrize("linked", ["../latest", "manifest.json", "arrays/0/zarr.json",
                                    "arrays/0/c/0/0"])
def test_an_infinity_file_symlinked_outside_is_refused(tmp_path, capsys, linked):
    tag = _infinity(tmp_path / "run")
    other = _infinity(tmp_path / "other")  # the same bytes: its checksums would even match
    (tag / linked).unlink()
    os.symlink(other / linked, tag / linked)
    refused(tmp_path, capsys, tmp_path / "run", "leads outside")


@pytest.mark.parametrize("linked", ["latest", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                                    "zero_pp_rank_0_mp_rank_00_model_states.pt", "a swap file"])
def test_a_deepspeed_file_symlinked_outside_is_refused(tmp_path, capsys, linked):
    for run in ("ds", "ds2"):
        deepspeed_layout.write(tmp_path / run, PARAMS, stage=3, world_size=2, nvme_offload=True)
    if linked == "a swap file":
        rank = tmp_path / "ds" / "global_step7" / "offloaded_tensors" / "rank01"
        linked = str(sorted(rank.glob("*.tensor.swp"))[0].relative_to(tmp_path / "ds"))
    elif linked != "latest":
        linked = f"global_step7/{linked}"
    (tmp_path / "ds" / linked).unlink()
    os.symlink(tmp_path / "ds2" / linked, tmp_path / "ds" / linked)
    refused(tmp_path, capsys, tmp_path / "ds", "leads outside")


@pytest.mark.parametrize("latest", ["../other/step1", "/etc", "..", "", "\xff"])
def test_an_infinity_latest_naming_no_tag_inside_is_refused(tmp_path, capsys, latest):
    _infinity(tmp_path / "run")
    _infinity(tmp_path / "other")
    (tmp_path / "run" / "latest").write_bytes(latest.encode("latin-1"))
    refused(tmp_path, capsys, tmp_path / "run", tmp_path / "run" / "latest")


@pytest.mark.parametrize("latest", ["../ds2/global_step7", "/tmp", "", "\xff"])
def test_a_deepspeed_latest_naming_no_tag_inside_is_refused(tmp_path, capsys, latest):
    deepspeed_layout.write(tmp_path / "ds", PARAMS, stage=3)
    deepspeed_layout.write(tmp_path / "ds2", PARAMS, stage=3)
    shutil.rmtree(tmp_path / "ds" / "global_step7")
    (tmp_path / "ds" / "latest").write_bytes(latest.encode("latin-1"))
    refused(tmp_path, capsys, tmp_path / "ds", tmp_path / "ds" / "latest")


def test_a_deepspeed_tag_symlinked_outside_or_given_outside_is_refused(tmp_path, capsys):
    deepspeed_layout.write(tmp_path / "ds", PARAMS, stage=3)
    deepspeed_layout.write(tmp_path / "ds2", PARAMS, stage=3)
    refused(tmp_path, capsys, tmp_path / "ds", "'../ds2/global_step7' leads outside",
            extra=("--tag", "../ds2/global_step7"))
    shutil.rmtree(tmp_path / "ds" / "global_step7")
    os.symlink(tmp_path / "ds2" / "global_step7", tmp_path / "ds" / "global_step7")
    refused(tmp_path, capsys, tmp_path / "ds", tmp_path / "ds" / "latest", "leads outside")


# -- a damaged manifest --
def _rename(old, new):
    return lambda body: _array(body, old).update(name=new)


Q0, Q1 = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"
EMBED = "model.embed_tokens.weight"
DAMAGE = {  # edit, complaint once signed (an attacker), complaint unsigned (an old manifest)
    "renamed": (_rename(Q0, "model.layers.2.self_attn.q_proj.weight"), "holds '" + Q0,
                "holds '" + Q0),
    "duplicated": (_rename(Q1, EMBED), "two tensors have the name", "two tensors have the name"),
    "same array": (lambda body: _array(body, EMBED).update(array=_array(body, Q1)["array"]),
                   "two tensors have the array", "two tensors have the array"),
    "missing": (lambda body: body["tensors"].remove(_array(body, Q0)), "no entry names the array",
                "no entry names the array"),
    "chunk_rows 0": (lambda body: _array(body, Q0).update(chunk_rows=0), "chunk_rows 0",
                     "chunk_rows 0"),
    "chunk_rows x": (lambda body: _array(body, Q0).update(chunk_rows="x"), "chunk_rows 'x'",
                     "chunk_rows 'x'"),
    "checksums": (lambda body: _array(body, Q0).update(crc32c=[]), "checksums expected",
                  "checksums expected"),
    "unknown field": (lambda body: body.update(extra=1), "unknown field 'extra'",
                      "unknown field 'extra'"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_manifest_fails_its_checksum(tmp_path, capsys, damage):
    tag = _infinity(tmp_path / "run")
    body = json.loads((tag / "manifest.json").read_text())
    DAMAGE[damage][0](body)
    (tag / "manifest.json").write_text(json.dumps(body))
    refused(tmp_path, capsys, tmp_path / "run", tag / "manifest.json",
            "does not match its checksum")


@pytest.mark.parametrize("signed", [True, False], ids=["resigned", "unsigned"])
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_manifest_is_refused_by_its_fields_too(tmp_path, capsys, damage, signed):
    tag = _infinity(tmp_path / "run")
    edit, when_signed, when_unsigned = DAMAGE[damage]
    _edit_manifest(tag, edit, sign=signed)
    refused(tmp_path, capsys, tmp_path / "run", when_signed if signed else when_unsigned)


def test_a_manifest_written_before_checksums_reads_with_a_warning(tmp_path, caplog):
    tag = _infinity(tmp_path / "run")
    _edit_manifest(tag, lambda body: None, sign=False)
    with caplog.at_level(logging.WARNING, logger="infinity.checkpoint.manifest"):
        reader = CheckpointReader(tmp_path / "run")
    assert "has no checksum of its own" in caplog.text
    for name, tensor in WEIGHTS.items():
        assert torch.equal(reader.read(name), tensor)


def test_a_tensor_name_that_is_no_zarr_path_is_refused_for_zarr(tmp_path, capsys):
    tag = _infinity(tmp_path / "run")
    _edit_manifest(tag, _rename(EMBED, "../../../x"))
    refused(tmp_path, capsys, tmp_path / "run", "'../../../x' cannot name a zarr array", to="zarr")
    assert not (tmp_path.parent / "x").exists()
