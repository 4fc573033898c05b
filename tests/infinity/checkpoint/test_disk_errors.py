"""A checkpoint save that fails on the disk (full, not writable) raises, leaves the previous
checkpoint and `latest` as they were, and leaves no debris."""

import errno
import os
import textwrap

import pytest
import torch

from infinity.checkpoint import CheckpointReader, CheckpointWriter, latest_tag


def test_a_full_disk_fails_the_save_and_keeps_the_previous_checkpoint(small_disk):
    directory = small_disk("4m")
    with CheckpointWriter(directory, "step1") as writer:
        writer.add("w", torch.ones(1 << 18))  # 1 MiB
    with pytest.raises(OSError) as info, CheckpointWriter(directory, "step2") as writer:
        writer.add("w", torch.ones(1 << 18))
        writer.add("big", torch.ones(1 << 20))  # 4 MiB more than fits
    assert info.value.errno == errno.ENOSPC
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
