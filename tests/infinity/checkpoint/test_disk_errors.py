"""A checkpoint save that fails on the disk (full, not writable) raises, leaves the previous
checkpoint and `latest` as they were, and leaves no debris."""

import errno
import os
import textwrap

import deepspeed_layout
import pytest
import torch

from infinity.checkpoint import CheckpointReader, CheckpointWriter, latest_tag
from infinity.cli.convert import main as convert
from infinity.models import write_shards


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(small_disk):
    directory = small_disk("4m")
    with CheckpointWriter(directory, "step1") as writer:
        writer.add("w", torch.ones(1 << 18))  # 1 MiB
    with pytest.raises(OSError) as info, CheckpointWriter(directory, "step2") as writer:
        writer.add("w", torch.ones(1 << 18))
        writer.add("big", torch.ones(1 << 20))  # 4 MiB more than fits
    assert info.value.errno == errno.ENOSPC and str(directory) in str(info.value)  # where
    assert sorted(p.name for p in directory.iterdir()) == ["latest", "step1"]
    assert latest_tag(directory) == "step1"
    assert torch.equal(CheckpointReader(directory).read("w"), torch.ones(1 << 18))
    with CheckpointWriter(directory, "step3") as writer:  # the space came back
        writer.add("w", torch.zeros(1 << 18))
    assert latest_tag(directory) == "step3"


def test_an_unwritable_directory_fails_before_anything_is_written(read_only_dir, run_unprivileged):
    """The run directory exists but may not be written: refused with its name, nothing made."""
    code = textwrap.dedent(f"""
        import torch
        from infinity.checkpoint import CheckpointWriter
        try:
            CheckpointWriter({read_only_dir!r}, "step1")
        except PermissionError as e:
            print("refused", e.filename)
    """)
    out = run_unprivileged(code, preload=("torch", "zarr", "infinity.checkpoint"))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(f"refused {read_only_dir}"), out.stdout + out.stderr
    assert os.listdir(read_only_dir) == []


def test_a_full_disk_names_the_path_it_was_writing(small_tmpfs, tmp_path, capsys):
    disk = small_tmpfs("1m")
    if disk is None:
        pytest.skip("mounting a small tmpfs needs root")
    deepspeed_layout.write(tmp_path / "ds", {"w": torch.randn(1 << 19)}, stage=3, world_size=1)
    assert convert([str(tmp_path / "ds"), str(disk / "out"), "--to", "safetensors"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err and str(disk / "out") in err
    assert list(disk.iterdir()) == []
    with pytest.raises(OSError) as info:  # infinity-train's export
        write_shards(disk, [("w", torch.Size([1 << 19]), torch.float32)],
                     iter([("w", torch.zeros(1 << 19))]), max_shard_bytes=1 << 30)
    assert info.value.errno == errno.ENOSPC
    assert str(disk / "model-00001-of-00001") in str(info.value)
