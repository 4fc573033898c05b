"""DeepSpeed ZeRO checkpoints (synthetic, with DeepSpeed's layout and pickles) read back without
DeepSpeed: exactly the weights and moments they were built from, and clear errors otherwise."""

import os
import pickle
import shutil
import sys

import deepspeed_layout
import pytest
import torch

from infinity.checkpoint.deepspeed import DeepSpeedReader, is_deepspeed_checkpoint
from infinity.errors import CheckpointError


def _params():
    g = torch.Generator().manual_seed(0)
    return {  # odd sizes, so every rank share and group ends in padding
        "embed.weight": torch.randn(13, 7, generator=g),
        "layers.0.weight": torch.randn(5, 3, generator=g),
        "layers.0.bias": torch.randn(5, generator=g),
        "layers.1.weight": torch.randn(9, 11, generator=g),
        "norm.weight": torch.randn(1, generator=g),
    }


EXTRAS = {"buffers": {"pos_ids": torch.arange(6), "running_mean": torch.randn(3)},
          "frozen": {"frozen.weight": torch.randn(3, 5)}, "shared": {"head.weight": "embed.weight"}}


def _check(reader, expected):
    assert sorted(reader.names()) == sorted(expected)
    for name, tensor in expected.items():
        got = reader.read(name)
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_stage_precision_and_rank_count_gives_back_the_weights(tmp_path, stage, precision,
                                                                     world_size):
    expected = deepspeed_layout.write(tmp_path, _params(), stage=stage, precision=precision,
                                      world_size=world_size, **EXTRAS, sub_group_numel=60,
                                      groups=[["embed.weight", "layers.0.weight"],
                                              ["layers.0.bias", "layers.1.weight", "norm.weight"]])
    assert "deepspeed" not in sys.modules, "the reader must run without DeepSpeed"
    reader = DeepSpeedReader(tmp_path)
    _check(reader, expected)
    assert reader.zero_stage == stage and reader.world_size == world_size
    assert reader.metadata["global_steps"] == 7 and reader.metadata["bf16"] == (precision == "bf16")
    assert reader.metadata["optimizer_step"] == 7
    assert reader.metadata["loss_scale"] == (2.0 ** 16 if precision == "fp16" else 1.0)


def test_a_param_spanning_sub_groups_and_ranks_streams_in_pieces(tmp_path):
    params = {"a": torch.randn(101), "b": torch.randn(3, 3)}
    deepspeed_layout.write(tmp_path, params, stage=3, world_size=4, sub_group_numel=50)
    reader = DeepSpeedReader(tmp_path / "global_step7")  # the tag directory works too
    pieces = list(reader.iter_chunks("a"))
    assert [p.numel() for p in pieces] == [26, 26, 26, 23]
    assert torch.equal(torch.cat(pieces), params["a"])


def test_a_tag_other_than_latest(tmp_path):
    deepspeed_layout.write(tmp_path, {"w": torch.ones(4)}, stage=3, tag="global_step1")
    deepspeed_layout.write(tmp_path, {"w": torch.full((4,), 2.0)}, stage=3, tag="global_step2")
    assert DeepSpeedReader(tmp_path).read("w").tolist() == [2.0] * 4
    assert DeepSpeedReader(tmp_path, "global_step1").read("w").tolist() == [1.0] * 4


def test_a_missing_rank_file_is_named(tmp_path):
    deepspeed_layout.write(tmp_path, _params(), stage=3, world_size=3)
    (tmp_path / "global_step7" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError,
                       match="missing rank file.*bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        DeepSpeedReader(tmp_path)


def test_a_missing_last_rank_is_caught_by_partition_count(tmp_path):
    deepspeed_layout.write(tmp_path, _params(), stage=2, world_size=2)
    (tmp_path / "global_step7" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match="partition_count is 2 .* missing: .*rank_1"):
        DeepSpeedReader(tmp_path)


def test_a_missing_stage3_model_states_file_is_named(tmp_path):
    deepspeed_layout.write(tmp_path, _params(), stage=3, world_size=2)
    (tmp_path / "global_step7" / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError,
                       match="zero_pp_rank_1_mp_rank_00_model_states.pt is missing"):
        DeepSpeedReader(tmp_path)


def test_a_truncated_file_is_named(tmp_path):
    deepspeed_layout.write(tmp_path, _params(), stage=3, world_size=2)
    path = tmp_path / "global_step7" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(CheckpointError,
                       match="bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt is truncated"):
        DeepSpeedReader(tmp_path)


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    assert not is_deepspeed_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="not a DeepSpeed checkpoint"):
        DeepSpeedReader(tmp_path)


def test_a_file_that_asks_to_run_code_is_refused(tmp_path):
    deepspeed_layout.write(tmp_path, _params(), stage=3, world_size=1)
    path = tmp_path / "global_step7" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": 3, "hook": os.system}}, path)
    with pytest.raises(CheckpointError, match=r"asks to load (posix|os)\.system"):
        DeepSpeedReader(tmp_path)
    torch.save({"optimizer_state_dict": {"zero_stage": 3, "hook": pickle.loads}}, path)
    with pytest.raises(CheckpointError, match="_pickle.loads|pickle.loads"):
        DeepSpeedReader(tmp_path)


def test_shapes_that_do_not_match_the_flat_groups_are_refused(tmp_path):
    deepspeed_layout.write(tmp_path, _params(), stage=3, world_size=2)
    other = tmp_path / "other"
    deepspeed_layout.write(other, {"w": torch.ones(3)}, stage=3, world_size=2)
    for rank in range(2):
        name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
        (tmp_path / "global_step7" / name).write_bytes((other / "global_step7" / name).read_bytes())
    with pytest.raises(CheckpointError,
                       match="param_shapes take 2 elements per rank but the fp32 groups hold"):
        DeepSpeedReader(tmp_path)


def test_tensor_parallel_checkpoints_are_refused_clearly(tmp_path):
    deepspeed_layout.write(tmp_path, _params(), stage=3, world_size=1)
    (tmp_path / "global_step7" / "bf16_zero_pp_rank_0_mp_rank_01_optim_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="tensor-parallel"):
        DeepSpeedReader(tmp_path)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_zero3_checkpoint_of_an_nvme_offloaded_optimizer_reads_its_swap_files(tmp_path,
                                                                                world_size):
    expected = deepspeed_layout.write(tmp_path, _params(), stage=3, world_size=world_size, **EXTRAS,
                                      sub_group_numel=60, nvme_offload=True)
    _check(DeepSpeedReader(tmp_path), expected)


@pytest.mark.parametrize("damage, complaint", [
    ("truncate", r"holds 8 bytes, its sub-group needs \d+ \(truncated\?\)"),
    ("delete",
     r"holds 3 'exp_avg-<first>_<last>.tensor.swp' files; the checkpoint has 4 sub-groups"),
    ("no rank dir", r"rank01 is missing"),
])
def test_damaged_swap_files_are_named(tmp_path, damage, complaint):
    deepspeed_layout.write(tmp_path, _params(), stage=3, world_size=2, sub_group_numel=60,
                           nvme_offload=True)
    folder = tmp_path / "global_step7" / "offloaded_tensors" / "rank01"
    if damage == "no rank dir":
        shutil.rmtree(folder)
    else:
        files = sorted(folder.glob("exp_avg-*.tensor.swp"))
        assert len(files) == 4, "the test needs several sub-groups"
        if damage == "truncate":
            os.truncate(files[1], 8)
        else:
            files[1].unlink()
    with pytest.raises(CheckpointError, match=complaint):
        DeepSpeedReader(tmp_path)
