"""The memory plan holds in practice: with host_memory_budget a quarter of the training state
(params + grads + Adam moments) and everything on NVMe, the peak RSS of training stays within the
RSS of the same work without the engine plus the budget plus a small slack (docs/engine.md,
"Peak host memory").

Each figure comes from a fresh child process (VmHWM cannot be reset)."""

import json

import pytest
import torch
from children import python_child

from infinity import BudgetError
from infinity.engine._plan import plan_memory
from infinity.store import Tier
from infinity.zero import FetchUnit

SLACK = 32 << 20  # allocator and aio bookkeeping, per docs/engine.md

_CHILD = r"""
import json, sys
import torch, transformers
mode, nvme_path = sys.argv[1], sys.argv[2]
torch.manual_seed(0)
cfg = transformers.GPT2Config(vocab_size=8192, n_embd=512, n_layer=12, n_head=8, n_positions=64)
model = transformers.GPT2LMHeadModel(cfg)
numel = sum(p.numel() for p in model.parameters())
budget = 16 * numel // 4  # a quarter of params + grads + two Adam moments, fp32
ids = torch.randint(0, 8192, (1, 32))
result = {"numel": numel, "budget": budget}
if mode == "baseline":  # the model as built, one forward/backward, each gradient dropped at once
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    model(input_ids=ids, labels=ids).loss.backward()
else:
    import infinity
    nvme = {"device": "nvme", "nvme_path": nvme_path}
    engine = infinity.initialize(model, {
        "train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_optimization": {"stage": 3, "offload_param": nvme, "offload_optimizer": nvme,
                              "sub_group_size": 1_000_000},
        "infinity": {"host_memory_budget": budget}})
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.close(restore_params=False)
with open("/proc/self/status") as f:
    result["peak_rss"] = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
print(json.dumps(result))
"""


def _child(mode: str, tmp_path) -> dict:
    done = python_child(["-c", _CHILD, mode, str(tmp_path)], timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_peak_rss_stays_within_the_budget_plus_the_baseline(tmp_path):
    baseline = _child("baseline", tmp_path)
    run = _child("engine", tmp_path)
    assert 500e6 <= 16 * run["numel"] <= 800e6  # a budget of 100-200 MB: large against the noise
    limit = baseline["peak_rss"] + run["budget"] + SLACK
    assert run["peak_rss"] <= limit, (
        f"peak RSS {run['peak_rss'] / 1e6:.0f} MB over {limit / 1e6:.0f} MB (baseline "
        f"{baseline['peak_rss'] / 1e6:.0f} MB + budget {run['budget'] / 1e6:.0f} MB + slack)")


def _unit(i: int, numel: int) -> FetchUnit:
    return FetchUnit(i, f"param/u{i}", f"u{i}", [], numel, torch.float32, True, False,
                     compute_dtype=torch.float32)


def test_prefetch_window_shrinks_to_what_the_host_budget_leaves():
    units = [_unit(i, 1 << 20) for i in range(40)]  # 40 units of 4 MiB
    kwargs = {"offload_param": "nvme", "offload_optimizer": "nvme", "accelerator": False,
              "prefetch_numel": 50_000_000, "tile_numel": 1 << 18}
    free = plan_memory(units, host_memory_budget=None, **kwargs)
    assert free.prefetch_numel >= 36 << 20  # no budget: about the whole model (all it could read ahead)
    tight = plan_memory(units, host_memory_budget=48 << 20, **kwargs)
    assert tight.grads_tier is Tier.NVME and tight.budgets[Tier.HOST] <= 48 << 20
    # 48 MiB less the smallest working set (2 units of params, 3 tiles + the values being
    # updated, 2 gradients passing through) leaves a window of a few units, not 200 MB of them.
    assert 0 < tight.prefetch_numel * 4 <= (48 << 20) - 5 * (4 << 20) - 3 * (3 << 20)


def test_a_budget_too_small_for_the_optimizer_tiles_names_sub_group_size():
    """At the default sub_group_size (1e9) a tile is a whole unit: a big embedding makes three
    of them exceed a modest budget; the error says which setting shrinks them."""
    units = [_unit(i, 1 << 24) for i in range(4)]  # 64 MiB units: tiles of 192 MiB
    kwargs = {"offload_param": "nvme", "offload_optimizer": "nvme", "accelerator": False, "prefetch_numel": 0}
    with pytest.raises(BudgetError, match=r"3 optimizer tiles of 16777216 elements \(zero_optimization."
                                          r"sub_group_size 1000000000: lower it"):
        plan_memory(units, host_memory_budget=512 << 20, tile_numel=1_000_000_000, **kwargs)
    small_tiles = plan_memory(units, host_memory_budget=512 << 20, tile_numel=1 << 20, **kwargs)
    assert small_tiles.budgets[Tier.HOST] <= 512 << 20
    assert small_tiles.tile_numel == 1 << 20  # on NVMe the tiles are sub_group_size's


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_the_plan_of_a_rank_counts_its_shards(stage):
    """With 4 ranks: the optimizer state from stage 1, the gradients from stage 2 and the
    parameters at stage 3 are a quarter of one process's (all in the host tier here), plus the
    whole-unit buffers of the collectives outside the store."""
    units = [_unit(i, 1 << 20) for i in range(8)]  # 8 units of 4 MiB
    kwargs = {"offload_param": "cpu", "offload_optimizer": "cpu", "accelerator": False,
              "prefetch_numel": 0, "tile_numel": 1 << 18, "host_memory_budget": None}
    one = plan_memory(units, **kwargs)
    rank = plan_memory(units, world=4, stage=stage, **kwargs)
    unit_nbytes, n = 4 << 20, len(units)
    params = n * unit_nbytes // (4 if stage == 3 else 1)
    state = 2 * n * unit_nbytes // (4 if stage >= 1 else 1)
    slack = n * (64 << 10)  # the tiles' slack: state in RAM is one tile per unit, whatever tile_numel
    assert (one.tile_numel, rank.tile_numel) == (1 << 20, (1 << 20) // (4 if stage >= 1 else 1))
    assert one.budgets[Tier.HOST] == n * unit_nbytes + 2 * n * unit_nbytes + slack
    assert rank.budgets[Tier.HOST] == params + state + slack
    grads = n * unit_nbytes // (4 if stage >= 2 else 1)
    collectives = {0: 0, 1: 2, 2: 3, 3: 3}[stage] * unit_nbytes
    assert rank.outside_store_nbytes == grads + collectives
