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
    # no budget: about the whole model (all it could read ahead)
    assert free.prefetch_numel >= 36 << 20
    tight = plan_memory(units, host_memory_budget=48 << 20, **kwargs)
    assert tight.grads_tier is Tier.NVME and tight.budgets[Tier.HOST] <= 48 << 20
    # 48 MiB less the smallest working set (2 units of params, 3 tiles of 8 B an element, the
    # moments of fp32 units, + the values being updated, 2 gradients passing through) leaves a
    # window of a few units, not 200 MB of them.
    assert 0 < tight.prefetch_numel * 4 <= (48 << 20) - 5 * (4 << 20) - 3 * (2 << 20)


def test_what_the_budget_leaves_caches_what_lives_on_nvme_up_to_all_of_it():
    """Parameters and optimizer state at home on NVMe: the host tier gets the working set
    (three of the largest unit here) and a few tiles, plus what the budget leaves, up to every
    parameter and all the state; none without a budget, none at the least budget, and nothing
    more where nothing lives on NVMe."""
    units = [_unit(i, 1 << 20) for i in range(40)]  # 40 units of 4 MiB: 160 MiB of values
    kwargs = {"offload_param": "nvme", "offload_optimizer": "nvme", "accelerator": False,
              "prefetch_numel": 0, "tile_numel": 1 << 18}
    bare = plan_memory(units, host_memory_budget=None, **kwargs)
    room = bare.budgets[Tier.HOST] + bare.outside_store_nbytes  # what the plan needs
    some = plan_memory(units, host_memory_budget=room + (20 << 20), **kwargs)
    assert some.budgets[Tier.HOST] == bare.budgets[Tier.HOST] + (20 << 20)
    values, state = 40 * (4 << 20), 40 * (8 << 20)  # fp32 units: two fp32 moments, no master
    for budget in (room + (1 << 30), room + (2 << 30)):  # all 160 + 320 MiB
        every = plan_memory(units, host_memory_budget=budget, **kwargs)
        assert values + state <= every.budgets[Tier.HOST] <= values + state + (64 << 20)
        assert every.budgets[Tier.HOST] == plan_memory(units, host_memory_budget=budget * 2,
                                                       **kwargs).budgets[Tier.HOST]
    params_only = {**kwargs, "offload_optimizer": "cpu"}  # the state is in the tier already
    assert plan_memory(units, host_memory_budget=1 << 32, **params_only).budgets[Tier.HOST] == \
        plan_memory(units, host_memory_budget=None, **params_only).budgets[Tier.HOST] + values \
        - 3 * (4 << 20)  # every parameter, 12 MiB of them the working set
    least = plan_memory(units, host_memory_budget=bare.min_host_budget, **kwargs)
    assert least.budgets[Tier.HOST] + least.outside_store_nbytes <= bare.min_host_budget
    host = {**kwargs, "offload_param": "cpu", "offload_optimizer": "cpu"}
    assert plan_memory(units, host_memory_budget=1 << 32, **host).budgets[Tier.HOST] == \
        plan_memory(units, host_memory_budget=None, **host).budgets[Tier.HOST]


def test_sub_group_size_is_an_upper_bound_the_plan_shrinks_to_fit(caplog):
    """At the default sub_group_size (1e9) a tile is a whole unit: three tiles of a big
    embedding (8 B an element: fp32 units' tiles hold the moments) exceed a modest budget. The
    plan picks the largest smaller tiles that fit (and says so) before it moves the gradients to
    NVMe; with tiles small enough it keeps them."""
    units = [_unit(i, 1 << 24) for i in range(4)]  # 64 MiB units: whole-unit tiles of 128 MiB
    kwargs = {"offload_param": "nvme", "offload_optimizer": "nvme", "accelerator": False,
              "prefetch_numel": 0}
    with caplog.at_level("INFO", logger="infinity.engine._plan"):
        plan = plan_memory(units, host_memory_budget=640 << 20, tile_numel=1_000_000_000,
                           **kwargs)
    assert plan.budgets[Tier.HOST] + plan.outside_store_nbytes <= 640 << 20
    assert plan.grads_tier is None  # 256 MiB of gradients stay in RAM: the tiles made room
    assert 1 << 18 <= plan.tile_numel < 1 << 24 and plan.tile_numel % 4096 == 0
    chose = f"optimizer tiles of {plan.tile_numel} elements (sub_group_size 1000000000"
    assert chose in caplog.text
    one_more = plan_memory(units, host_memory_budget=640 << 20,
                           tile_numel=plan.tile_numel + 4096, **kwargs)
    assert one_more.tile_numel == plan.tile_numel  # the largest that fits was picked
    small = plan_memory(units, host_memory_budget=640 << 20, tile_numel=1 << 20, **kwargs)
    assert small.tile_numel == 1 << 20  # an asked size that fits is kept
    # twice the units: 600 MiB cannot hold their 512 MiB of gradients beside two units and the
    # smallest tiles, but can with two passing through the tier and two arriving beside it
    tight = plan_memory(units * 2, host_memory_budget=600 << 20, tile_numel=1_000_000_000,
                        **kwargs)
    assert tight.grads_tier is Tier.NVME
    assert tight.budgets[Tier.HOST] + tight.outside_store_nbytes <= 600 << 20


def test_below_the_smallest_plan_the_error_names_the_budget_that_works():
    units = [_unit(i, 1 << 24) for i in range(8)]
    kwargs = {"offload_param": "nvme", "offload_optimizer": "nvme", "accelerator": False,
              "prefetch_numel": 0, "tile_numel": 1_000_000_000}
    least = plan_memory(units, host_memory_budget=None, **kwargs).min_host_budget
    assert least < 3 * 12 * (1 << 24)  # less than three whole-unit tiles alone
    message = rf"host_memory_budget {least - 1} bytes .* at least {least} bytes" \
        rf".*set infinity.host_memory_budget to at least {least}$"
    with pytest.raises(BudgetError, match=message):
        plan_memory(units, host_memory_budget=least - 1, **kwargs)
    fits = plan_memory(units, host_memory_budget=least, **kwargs)
    assert fits.budgets[Tier.HOST] + fits.outside_store_nbytes <= least
    assert fits.tile_numel == 1 << 18 and fits.grads_tier is Tier.NVME


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
    # the tiles' slack: state in RAM is one tile per unit, whatever tile_numel
    slack = n * (64 << 10)
    assert (one.tile_numel, rank.tile_numel) == (1 << 20, (1 << 20) // (4 if stage >= 1 else 1))
    assert one.budgets[Tier.HOST] == n * unit_nbytes + 2 * n * unit_nbytes + slack
    assert rank.budgets[Tier.HOST] == params + state + slack
    grads = n * unit_nbytes // (4 if stage >= 2 else 1)
    collectives = {0: 0, 1: 2, 2: 3, 3: 3}[stage] * unit_nbytes
    assert rank.outside_store_nbytes == grads + collectives


def test_a_speculated_step_gets_room_for_the_old_state_beside_the_new():
    """Overlapped with clipping or fp16 the old state is kept until the step is validated: NVMe
    (state there) or the host tier (state in RAM, within the budget) gets room for a second
    copy of the state (8 B/element, fp32 units) and of the trained values (4 B/element)."""
    units = [_unit(i, 1 << 20) for i in range(8)]  # 8 units of 1M fp32 elements
    kwargs = {"offload_param": "nvme", "accelerator": False, "prefetch_numel": 0,
              "tile_numel": 1 << 18, "host_memory_budget": None}
    for offload, tier in (("nvme", Tier.NVME), ("cpu", Tier.HOST)):
        plain = plan_memory(units, offload_optimizer=offload, **kwargs)
        speculated = plan_memory(units, offload_optimizer=offload, speculates=True, **kwargs)
        extra = speculated.budgets[tier] - plain.budgets[tier]
        assert 8 * (12 << 20) <= extra <= 8 * (12 << 20) * 9 // 8 + (4 << 20), offload
    capped = plan_memory(units, offload_optimizer="cpu", speculates=True,
                         **{**kwargs, "host_memory_budget": 200 << 20})
    assert capped.budgets[Tier.HOST] <= 200 << 20  # the budget still caps it


def test_units_computed_in_a_wider_dtype_and_arriving_gradients_count_outside_the_store():
    """bf16 units computed in fp32 (a CPU without bf16 units) are used through fp32 copies made
    outside the store (the resident units' and two of the largest); gradients whose home is the
    store arrive as autograd's, in the compute dtype (two of the largest). Both come out of the
    budget, not on top of it; computing in the values' dtype, or on an accelerator, adds no
    copies."""
    def unit(i: int, numel: int, compute: torch.dtype, persistent: bool = False) -> FetchUnit:
        return FetchUnit(i, f"param/u{i}", f"u{i}", [], numel, torch.bfloat16, True, persistent,
                         compute_dtype=compute)

    def units(compute: torch.dtype) -> list[FetchUnit]:
        return [unit(0, 1 << 10, compute, persistent=True)] + \
            [unit(i, (1 << 20) * (2 if i == 3 else 1), compute) for i in range(1, 9)]

    kwargs = {"offload_param": "nvme", "offload_optimizer": "nvme", "prefetch_numel": 0,
              "tile_numel": 1 << 18}
    budget = 96 << 20  # less than the tier would cache: it takes all the budget leaves
    same = plan_memory(units(torch.bfloat16), accelerator=False, host_memory_budget=budget,
                       **kwargs)
    wider = plan_memory(units(torch.float32), accelerator=False, host_memory_budget=budget,
                        **kwargs)
    copies = 4 * (1 << 10) + 2 * 4 * (2 << 20)  # the resident unit's, two of the largest
    assert (same.grads_tier, wider.grads_tier) == (None, None)  # gradients in RAM: no arrivals
    grads = 4096 + 4 * 9 * (1 << 20)  # every gradient held in fp32, each page-aligned
    assert wider.outside_store_nbytes == grads + copies
    assert same.outside_store_nbytes == 4096 + 2 * 9 * (1 << 20)  # in bf16
    assert wider.budgets[Tier.HOST] + wider.outside_store_nbytes == budget
    assert same.budgets[Tier.HOST] + same.outside_store_nbytes == budget
    assert wider.min_host_budget - same.min_host_budget >= copies
    on_gpu = plan_memory(units(torch.float32), accelerator=True, host_memory_budget=budget,
                         **kwargs)
    assert on_gpu.outside_store_nbytes == grads  # upcast and computed on the device
    tight = plan_memory(units(torch.float32), accelerator=False,
                        host_memory_budget=wider.min_host_budget, **kwargs)
    assert tight.grads_tier is Tier.NVME  # the smallest budget stores the gradients
    assert tight.outside_store_nbytes == copies + 2 * 4 * (2 << 20)  # and two arrive at a time
    assert tight.budgets[Tier.HOST] + tight.outside_store_nbytes <= wider.min_host_budget


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32])
def test_units_gathered_at_stage_3_then_widened_count_both_copies(compute):
    """At stage 3 over ranks a unit is gathered in its values' dtype and, computed wider, upcast
    from that: while one unit is in use the next one's gather is in flight and the one being
    upcast still holds its gathered buffer, so the plan counts two of the largest gathered
    buffers (bf16) beside the fp32 copies (the resident unit's and two of the largest).
    Computed in bf16, the gathered buffers are the copies."""
    def unit(i: int, numel: int, persistent: bool = False) -> FetchUnit:
        return FetchUnit(i, f"param/u{i}", f"u{i}", [], numel, torch.bfloat16, True, persistent,
                         compute_dtype=compute)

    units = [unit(0, 1 << 10, persistent=True)] + \
        [unit(i, (1 << 20) * (2 if i == 3 else 1)) for i in range(1, 9)]
    kwargs = {"offload_param": "nvme", "offload_optimizer": "nvme", "prefetch_numel": 0,
              "tile_numel": 1 << 18, "accelerator": False, "host_memory_budget": None}
    one = plan_memory(units, **kwargs)
    rank = plan_memory(units, world=2, stage=3, **kwargs)
    gathered = 2 * 1024 + 2 * 2 * (2 << 20)  # bf16: the resident unit, two of the largest
    copies = 4 * 1024 + 2 * 4 * (2 << 20) if compute == torch.float32 else 0
    # one process: whole gradients in the compute dtype; a rank at stage 3: its shards, each
    # page-aligned, and one whole gradient being reduce-scattered
    itemsize = compute.itemsize
    shards = 4096 + 8 * (1 << 20) // 2 * itemsize + (1 << 20) // 2 * itemsize
    assert one.outside_store_nbytes == 4096 + 9 * (1 << 20) * itemsize + copies
    assert rank.outside_store_nbytes == shards + (2 << 20) * itemsize + gathered + copies
