"""Checkpoints of data-parallel ranks (gloo, 2 processes): a run saved on 2 ranks resumes on 2
ranks bit for bit (each rank's RNG state included), and on 1 rank (the checkpoint holds whole
tensors; each rank takes its part on load) exactly as saved and then as one process trains on
the concatenated batch; a save that fails on rank 0 fails on every rank. See [Note: checkpoints
of several ranks] in infinity/engine/_checkpoint.py.

Compressed optimizer state (`infinity.optimizer_state`, bf16 parameters): at stages 1-3 with
int8 moments or bf16 moments, both without an fp32 master, each rank holds only its shard's
state (the bytes its shard's tiles take in the format), and a 2-rank run resumes bit for bit
(codes, scales and each rank's stochastic rounding stream); one rank loads it exactly as saved.
Its cases ride in the same launches.
"""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from _ranks_child import MICRO  # noqa: E402
from test_engine_ranks import WORLD, _config, _relative, _torchrun  # noqa: E402

from infinity.optim import StateFormat  # noqa: E402

# One worker runs this module: its fixture runs once (--dist=loadgroup in pyproject.toml).
pytestmark = pytest.mark.xdist_group("ranks_checkpoint")

STEPS, SAVE_AFTER = 6, 3
STAGES = [1, 2, 3]
COMPRESSED = [(stage, moments) for stage in STAGES for moments in ("int8", "bf16")]
HIDDEN = 300  # compressed cases: 3905 parameters, so a rank's shard spans several 8-bit blocks


def _stage_config(stage, nvme, **extra):
    return {**_config(stage, nvme=nvme), **extra}


def _compressed_name(stage, moments):
    return f"stage{stage}-{moments}-none"


def _compressed_case(stage, moments, nvme, **extra):
    config = _config(stage, nvme=nvme, bf16={"enabled": True})
    config["zero_optimization"]["sub_group_size"] = 1 << 20  # one tile per unit's shard
    config["infinity"] = {**config["infinity"], "compute_dtype": "fp32",
                          "optimizer_state": {"moments": moments, "master": "none"}}
    return {"name": _compressed_name(stage, moments), "config": config, "steps": STEPS,
            "hidden": HIDDEN, **extra}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launch 1 (2 ranks): train STEPS steps, saving after SAVE_AFTER. Launch 2 (2 ranks):
    resume from it. Launch 3 (1 rank): resume from it on both ranks' rows. Plus a save whose
    directory rank 0 cannot create."""
    tmp = tmp_path_factory.mktemp("ranks-ckpt")
    nvme = tmp / "nvme"
    nvme.mkdir()
    (tmp / "a-file").write_text("not a directory")
    first = [{"name": f"stage{s}", "config": _stage_config(s, nvme), "steps": STEPS,
              "save": str(tmp / f"ckpt{s}"), "save_after": SAVE_AFTER} for s in STAGES]
    first.append({"name": "unwritable", "config": _config(3), "steps": 1, "save_after": 1,
                  "save": str(tmp / "a-file" / "ckpt")})
    first += [_compressed_case(*c, nvme, save=str(tmp / _compressed_name(*c)),
                               save_after=SAVE_AFTER) for c in COMPRESSED]
    resumed = [{"name": f"stage{s}", "config": _stage_config(s, nvme), "steps": STEPS,
                "load": str(tmp / f"ckpt{s}")} for s in STAGES]
    resumed.append({"name": "load-fails-on-rank-1", "config": _stage_config(3, nvme),
                    "steps": STEPS, "load": [str(tmp / "ckpt3"), str(tmp / "no-checkpoint-here")]})
    resumed += [_compressed_case(*c, nvme, load=str(tmp / _compressed_name(*c)))
                for c in COMPRESSED]
    alone = [{"name": f"stage{s}", "steps": STEPS, "load": str(tmp / f"ckpt{s}"),
              "data_world": WORLD,
              "config": _stage_config(s, nvme, train_micro_batch_size_per_gpu=WORLD * MICRO)}
             for s in STAGES]
    alone += [_compressed_case(*c, nvme, load=str(tmp / _compressed_name(*c)), steps=SAVE_AFTER + 1,
                               data_world=WORLD) for c in COMPRESSED]
    results = []
    for name, cases, world in (("first", first, WORLD), ("resumed", resumed, WORLD),
                               ("alone", alone, 1)):
        (tmp / name).mkdir()
        (code, output), per_rank = _torchrun(tmp / name, cases, timeout_s=240, world=world)
        assert code == 0, f"torchrun ({name}) exited {code}:\n{output[-3000:]}"
        results.append(per_rank)
    return results


def _flat(params):
    return torch.cat([p.flatten() for p in params.values()])


@pytest.mark.parametrize("stage", STAGES)
def test_two_ranks_resume_bit_for_bit(runs, stage):
    first, resumed, _ = runs
    name = f"stage{stage}"
    for rank in range(WORLD):
        a, b = first[rank][name], resumed[rank][name]
        assert "error" not in a and "error" not in b, (a, b)
        assert torch.equal(_flat(b["loaded"]), _flat(a["saved"])), rank
        assert torch.equal(b["draw"], a["draw"]), rank  # each rank's own RNG state
        assert b["losses"] == a["losses"][SAVE_AFTER:], rank
        assert torch.equal(_flat(b["params"]), _flat(a["params"])), rank


@pytest.mark.parametrize("stage", STAGES)
def test_one_rank_resumes_a_two_rank_checkpoint(runs, stage):
    """Repartitioned on load: exactly the saved values; then one process on the concatenated
    batch follows the 2-rank run to <= 1e-5 (the same sums in another order)."""
    first, _, alone = runs
    name = f"stage{stage}"
    (one,) = [r[name] for r in alone]
    assert "error" not in one, one
    assert torch.equal(_flat(one["loaded"]), _flat(first[0][name]["saved"]))
    assert torch.equal(one["draw"], first[0][name]["draw"])  # rank 0's RNG state
    two_rank_losses = torch.tensor([r[name]["losses"][SAVE_AFTER:] for r in first]).mean(0)
    assert _relative(torch.tensor(one["losses"]), two_rank_losses) <= 1e-5
    for key, value in first[0][name]["params"].items():
        assert _relative(one["params"][key], value) <= 1e-5, key


def test_a_load_that_fails_on_one_rank_fails_on_every_rank(runs):
    """Rank 1 finds no checkpoint where rank 0 loads one: both raise (rank 1 its own error),
    neither trains on."""
    _, resumed, _ = runs
    zero, one = (resumed[rank]["load-fails-on-rank-1"] for rank in range(WORLD))
    assert "no-checkpoint-here" in one["message"], one
    assert "CheckpointError" in zero["error"], zero
    assert zero["message"].startswith("rank 1 could not load the checkpoint from"), zero


def test_a_save_rank_0_cannot_write_fails_on_every_rank(runs):
    first, _, _ = runs
    zero, one = (first[rank]["unwritable"] for rank in range(WORLD))
    assert "OSError" in zero["error"], zero
    assert ("CheckpointError" in one["error"]
            and "rank 0 could not write checkpoint" in one["message"]), one


@pytest.mark.parametrize("stage, moments", COMPRESSED)
def test_ranks_partition_compressed_state_and_resume_it_bit_for_bit(runs, stage, moments):
    first, resumed, alone = runs
    name = _compressed_name(stage, moments)
    fmt = StateFormat(moments, "none")
    a = [first[rank][name] for rank in range(WORLD)]
    b = [resumed[rank][name] for rank in range(WORLD)]
    for r in a + b:
        assert "error" not in r, r
    assert all(p.dtype == torch.bfloat16 for p in a[0]["params"].values())
    assert torch.equal(_flat(a[0]["params"]), _flat(a[1]["params"]))  # one model on both
    assert not torch.equal(_flat(a[0]["saved"]), _flat(a[0]["params"]))  # it trains
    # Each rank's state is its own shard's tiles in the format, about half the model's.
    whole = sum(p.numel() for p in a[0]["params"].values())
    for rank in range(WORLD):
        stats, owned = a[rank]["optimizer"], a[rank]["owned"]
        assert stats["state_format"] == {"moments": moments, "master": "none", "block": 256}
        shard = sum(numel for numel, _ in owned)
        assert whole // WORLD <= shard <= -(-whole // WORLD) + len(owned), (rank, owned)
        expected = sum(fmt.layout(numel, torch.bfloat16).nbytes for numel, _ in owned)
        assert stats["state_bytes"] == expected, (rank, stats["state_bytes"], expected)
    for rank in range(WORLD):
        assert torch.equal(_flat(b[rank]["loaded"]), _flat(a[rank]["saved"])), rank
        assert b[rank]["losses"] == a[rank]["losses"][SAVE_AFTER:], rank
        assert torch.equal(_flat(b[rank]["params"]), _flat(a[rank]["params"])), rank
    # One rank takes both shards' state (each rank's tiles coded on its own blocks) and steps.
    (one,) = [r[name] for r in alone]
    assert "error" not in one, one
    assert torch.equal(_flat(one["loaded"]), _flat(a[0]["saved"]))
    assert sum(numel for numel, _ in one["owned"]) == whole
    assert one["optimizer"]["state_bytes"] == sum(fmt.layout(numel, torch.bfloat16).nbytes
                                                  for numel, _ in one["owned"])
