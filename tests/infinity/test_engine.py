"""Engine parity: training through infinity.initialize equals plain PyTorch + torch.optim.AdamW
for every offload combination, with accumulation and clipping (non-finite gradients and fp16
overflow: test_engine_nonfinite.py)."""

import copy
import json
import math
import threading

import pytest
import torch
import transformers

import infinity
from infinity import BudgetError, ConfigError
from infinity.store import Tier
from infinity.zero import StoredGrad

DEVICES = ["none", "cpu", "nvme"]
LR, WD = 1e-2, 0.01

def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 4))


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=32, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    return model


def config(tmp_path, param="none", optimizer="none", lr=LR, **extra) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 600,
            "stage3_max_reuse_distance": 0, "sub_group_size": 256}
    for key, device in (("offload_param", param), ("offload_optimizer", optimizer)):
        zero[key] = {"device": device, **({"nvme_path": str(tmp_path)} if device == "nvme" else {})}
    zero.update(extra.pop("zero", {}))
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": WD}},
            "zero_optimization": zero, **{"infinity": {"host_memory_budget": "1GB"}, **extra}}


def mlp_batches(n):
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(2, 8, generator=g),), {}) for _ in range(n)]


def llama_batches(n):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 48, (2, 8), generator=g)
        out.append(((), {"input_ids": ids, "labels": ids}))
    return out


def loss_of(out):
    return out.loss if hasattr(out, "loss") else out.square().mean()


def train_reference(model, batches, *, gas=1, clip=0.0, lr=LR):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WD)
    losses = []
    for i, (args, kwargs) in enumerate(batches):
        loss = loss_of(model(*args, **kwargs))
        (loss / gas).backward()
        losses.append(loss.item())
        if (i + 1) % gas == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return losses


def train_engine(engine, batches):
    losses = []
    for args, kwargs in batches:
        loss = loss_of(engine(*args, **kwargs))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def assert_parity(model, reference, losses, ref_losses):
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 1e-5 * abs(want), (losses, ref_losses)
    want = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        scale = want[name].abs().max().item()
        assert (p - want[name]).abs().max().item() <= 1e-5 * scale, name


def stepped_after_backward(model, tmp_path, data, **extra):
    """Train `model` on `data` (NVMe, as config's) with every unit stepped after backward
    (overlap_optimizer false): the (losses, parameters) an overlapped run must equal exactly,
    as [Note: optimizer overlapped with backward] says (the same kernel calls)."""
    extra["infinity"] = {"host_memory_budget": "1GB", **extra.get("infinity", {}),
                         "overlap_optimizer": False}
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme", **extra))
    assert not engine.overlap
    losses = train_engine(engine, data)
    engine.close()
    return losses, dict(model.named_parameters())


def assert_identical(model, losses, other):
    """Bit for bit: the same losses and parameters as `other` = (losses, parameters)."""
    other_losses, other_params = other
    assert losses == other_losses
    for name, p in model.named_parameters():
        assert torch.equal(p, other_params[name]), name


# Every offload pair on the MLP; on the Llama (a transformers model, tied embeddings) each
# device of each kind and all on NVMe: its other pairs run the same code paths again.
PARITY = [(mlp, mlp_batches, param, optimizer) for param in DEVICES for optimizer in DEVICES] + [
    (llama, llama_batches, param, optimizer)
    for param, optimizer in (("none", "none"), ("cpu", "nvme"), ("nvme", "cpu"), ("nvme", "nvme"))]


@pytest.mark.parametrize("make, batches, param, optimizer", PARITY,
                         ids=[f"{make.__name__}-{p}-{o}" for make, _, p, o in PARITY])
def test_training_matches_pytorch(tmp_path, make, batches, param, optimizer):
    model = make()
    reference = copy.deepcopy(model)
    data = batches(10)
    engine = infinity.initialize(model, config(tmp_path, param, optimizer))
    # sub_group_size 256 cuts the state into tiles on NVMe only; in RAM a unit is one tile
    assert (len(engine.optimizer.tiles) == len(engine.optimizer.units)) == (optimizer != "nvme")
    losses = train_engine(engine, data)
    assert engine.global_steps == 10
    engine.close()
    assert_parity(model, reference, losses, train_reference(reference, data))


@pytest.mark.parametrize("make, batches", [(mlp, mlp_batches), (llama, llama_batches)],
                         ids=["mlp", "llama"])
def test_accumulation_and_clipping_match_pytorch(tmp_path, make, batches):
    model = make()
    reference = copy.deepcopy(model)
    data = batches(12)
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme",
                                               gradient_accumulation_steps=3,
                                               gradient_clipping=0.05))
    losses = train_engine(engine, data)
    assert engine.global_steps == 4 and engine.micro_steps == 12
    assert engine.last_grad_norm > 0.05  # clipping really acted
    engine.close()
    assert_parity(model, reference, losses, train_reference(reference, data, gas=3, clip=0.05))


def test_gradients_go_to_nvme_when_the_host_budget_cannot_hold_them(tmp_path):
    model = llama()
    reference = copy.deepcopy(model)
    data = llama_batches(6)
    # About 80 KB of gradients in RAM plus a 220 KB host tier would not fit in 240 KB.
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme",
                                               gradient_accumulation_steps=2,
                                               infinity={"host_memory_budget": 240_000}))
    assert engine.plan.grads_tier is not None and engine.plan.outside_store_nbytes == 0
    assert engine.plan.budgets[Tier.HOST] <= 240_000
    losses = train_engine(engine, data)
    assert all(isinstance(u.grad, StoredGrad) for u in engine.units if u.requires_grad)
    engine.close()
    assert_parity(model, reference, losses, train_reference(reference, data, gas=2))


def test_stage_0_and_persistent_parameters_match_pytorch(tmp_path):
    for param, zero in (("none", {"stage": 0}),
                        ("cpu", {"stage3_param_persistence_threshold": 40})):
        model = mlp()
        reference = copy.deepcopy(model)
        data = mlp_batches(5)
        engine = infinity.initialize(model, config(tmp_path, param, "cpu", zero=zero))
        losses = train_engine(engine, data)
        engine.close()
        assert_parity(model, reference, losses, train_reference(reference, data))


def test_prefetch_leaves_no_on_demand_fetch_after_the_first_step(tmp_path):
    engine = infinity.initialize(llama(), config(tmp_path, "nvme", "nvme"))
    data = llama_batches(6)
    train_engine(engine, data[:1])
    after_first = engine.stats()["prefetch"]
    assert after_first["on_demand_nvme"] > 0
    for args, kwargs in data[1:]:  # eval, train, eval, ...: the first eval follows the train trace
        with torch.no_grad():
            engine.eval()(*args, **kwargs)
        engine.train()
        train_engine(engine, [(args, kwargs)])
    stats = engine.stats()["prefetch"]
    assert stats["on_demand"] == after_first["on_demand"]
    assert stats["on_demand_nvme"] == after_first["on_demand_nvme"]
    assert stats["prefetch_hits"] > after_first["prefetch_hits"] and stats["divergences"] == 0
    assert (engine.coordinator.traces((True, True)) == 1
            and engine.coordinator.traces((False, False)) == 1)
    engine.close()


class _WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("offload", ["cpu", "nvme"])  # stepped after backward / during it
def test_a_unit_without_a_gradient_is_stepped_with_a_zero_gradient(tmp_path, offload):
    """As DeepSpeed (torch's AdamW skips a parameter without .grad): weight decay and the
    moments' decay apply to the unused module too."""
    model, reference, data = _WithUnused(), _WithUnused(), mlp_batches(3)
    engine = infinity.initialize(model, config(tmp_path, offload, offload))
    losses = train_engine(engine, data)
    engine.close()
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    ref_losses = []
    for (x,), _ in data:
        loss = reference(x).square().mean()
        loss.backward()
        for p in reference.unused.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    assert not torch.equal(model.unused.weight, _WithUnused().unused.weight)  # decayed
    assert_parity(model, reference, losses, ref_losses)


def test_lr_schedule_follows_deepspeed_warmup(tmp_path):
    engine = infinity.initialize(mlp(), config(tmp_path, scheduler={
        "type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                       "warmup_num_steps": 4, "warmup_type": "linear"}}))
    lrs = [engine.get_lr()[0]]
    for batch in mlp_batches(5):
        train_engine(engine, [batch])
        lrs.append(engine.get_lr()[0])
    engine.close()
    # before any step the minimum; after step k (from 1) lr = 0.01 * min(1, (k - 1) / 4)
    assert lrs == pytest.approx([0.0, 0.0, 0.0025, 0.005, 0.0075, 0.01], rel=1e-12, abs=0)


def test_close_removes_every_hook_and_restores_parameters(tmp_path):
    model = llama()
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme"))
    train_engine(engine, llama_batches(2))
    values = dict(engine.named_parameters())
    engine.close()
    for m in model.modules():
        assert not m._forward_pre_hooks and not m._forward_hooks and not m._backward_hooks
    for name, p in model.named_parameters():
        assert not p._post_accumulate_grad_hooks, name
        assert torch.equal(p.detach(), values[name]), name
    with pytest.raises(RuntimeError, match="closed"):
        engine(torch.zeros(1, 8, dtype=torch.long))



@pytest.mark.parametrize("param", ["none", "cpu"])
def test_parameters_not_offloaded_stay_bound_with_no_hook_per_module(tmp_path, param):
    """offload_param none on one process, the optimizer stepped after backward ("auto" on the
    CPU): the values never leave the tier modules compute from, so every unit is resident
    (bound from the first forward to the step, no fetch per use, no saved-tensor hooks);
    offloaded ones are released after each use (placeholders)."""
    model = llama()
    engine = infinity.initialize(model, config(tmp_path, param, "none", infinity={
        "host_memory_budget": "1GB", "overlap_optimizer": False}))
    hooked = [m for m in model.modules() if m._forward_pre_hooks and m is not model]
    assert all(u.persistent for u in engine.units) == (param == "none")
    assert bool(hooked) == (param == "cpu")
    args, kwargs = llama_batches(1)[0]
    out = engine(*args, **kwargs)
    bound = [p.numel() > 0 for p in model.parameters()]
    assert all(bound) if param == "none" else not any(bound)
    assert (engine.coordinator.stats.acquires > 0) == (param == "cpu")
    engine.backward(loss_of(out))
    engine.step()
    engine.close()


def test_stats_and_trace(tmp_path):
    engine = infinity.initialize(mlp(), config(tmp_path, "nvme", "nvme"))
    train_engine(engine, mlp_batches(2))
    stats = engine.stats()
    assert stats["global_steps"] == 2 and stats["peak_rss_bytes"] > 0
    assert stats["prefetch"]["acquires"] > 0 and "nvme->host" in stats["store"]["moves"]
    engine.write_trace(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert any(e.get("cat") == "nvme->host" for e in events)
    engine.close()


def test_bad_input_is_refused_with_a_clear_error(tmp_path):
    with pytest.raises(TypeError, match="torch.nn.Module"):
        infinity.initialize("model", {})
    with pytest.raises(ConfigError, match="stage3_prefetch_bucket_size"):
        infinity.initialize(mlp(), {"zero_optimization": {"stage3_prefetch_bucket_sise": 1}})
    with pytest.raises(BudgetError, match="host_memory_budget"):
        infinity.initialize(mlp(), {**config(tmp_path, "cpu", "cpu"),
                                    "infinity": {"host_memory_budget": 4096}})
    engine = infinity.initialize(mlp(), config(tmp_path))
    (x,), _ = mlp_batches(1)[0]
    with pytest.raises(ValueError, match="scalar loss"):
        engine.backward(engine(x))
    engine.close()


@pytest.mark.parametrize("optimizer, steps, compute", [("nvme", 50, "bf16"), ("none", 10, "bf16"),
                                                       ("nvme", 20, "fp32")])
def test_bf16_tracks_the_fp32_reference(tmp_path, optimizer, steps, compute):
    """bf16 values with an fp32 master in the optimizer, computing in bf16 or (upcast when
    fetched) in fp32: the loss stays within 1% of fp32's."""
    model = llama()
    reference = copy.deepcopy(model)
    data = llama_batches(2) * (steps // 2)  # two batches again and again: the loss falls
    engine = infinity.initialize(model, config(tmp_path, "nvme", optimizer, lr=3e-3,
                                               bf16={"enabled": True},
                                               infinity={"host_memory_budget": "1GB",
                                                         "compute_dtype": compute}))
    assert {u.dtype for u in engine.units} == {torch.bfloat16}
    expected = torch.bfloat16 if compute == "bf16" else torch.float32
    assert {p.dtype for p in model.parameters()} == {expected}
    assert {u.compute_dtype for u in engine.units} == {expected}
    losses = train_engine(engine, data)
    engine.close()
    ref_losses = train_reference(reference, data, lr=3e-3)
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it learned something to track
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 0.01 * want, (losses, ref_losses)


class _WaitInBackward(torch.autograd.Function):
    """Identity whose backward first calls `wait()`: the compute of the first layers' backward."""

    @staticmethod
    def forward(ctx, x, wait):
        ctx.wait = wait
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.wait()
        return grad, None


class _BackwardGate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wait = lambda: None

    def forward(self, x):
        return _WaitInBackward.apply(x, self.wait)


def test_optimizer_overlaps_backward_on_the_timeline(tmp_path):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 8) for _ in range(4)]
    gate = _BackwardGate()
    model = torch.nn.Sequential(layers[0], gate, *layers[1:])
    reference = copy.deepcopy(model)
    data = mlp_batches(2)
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme"))
    assert engine.overlap
    last = next(i for i, u in enumerate(engine.ranked.trained) if u.key == "param/4")

    def last_layer_stepped():  # backward of layer 0 waits until the worker stepped layer 4
        future = engine._stepper.future(last)
        assert future is not None, "layer 4 was not handed to the worker before layer 0's backward"
        future.result(timeout=60)

    gate.wait = last_layer_stepped
    losses = train_engine(engine, data)
    regions = engine.timeline.regions
    engine.write_trace(tmp_path / "trace.json")
    engine.close()
    assert_parity(model, reference, losses, train_reference(reference, data))

    first, last = "param/0", "param/4"
    first_final = [r.start for r in regions if r.lane == "grads final" and r.name == first]
    last_stepped = [r.end for r in regions if r.lane == "optimizer" and r.name == last]
    assert len(first_final) == len(last_stepped) == 2
    for done, stepped in zip(first_final, last_stepped):
        assert stepped < done  # the last layer was updated while backward still ran
    lanes = {e.get("cat") for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]}
    assert {"optimizer", "compute", "grads final", "nvme->host"} <= lanes


def test_the_worker_reads_the_next_units_state_while_it_steps_one(tmp_path):
    """Units queue on the optimizer worker when it is slower than backward; the one after the
    running unit has its state read meanwhile (prefetch_unit), and the result is unchanged."""
    model, reference, data = mlp(), mlp(), mlp_batches(2)
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme"))
    opt, asked = engine.optimizer, []
    prefetch_unit = opt.prefetch_unit

    def spy_prefetch_unit(u):
        asked.append((u, opt.completed_steps))
        return prefetch_unit(u)

    opt.prefetch_unit = spy_prefetch_unit
    _hold_the_worker(engine)  # slower than backward: it steps the first unit once backward ended
    losses = train_engine(engine, data)
    assert engine.units_stepped_in_backward == 6
    engine.close()
    assert_parity(model, reference, losses, train_reference(reference, data))
    # Backward makes units 2, 1, 0 final in that order and the worker runs one while the others
    # wait behind it: in each step, two of them were read ahead while another was stepped
    # (which two depends on when the held worker starts relative to the tail's reordering).
    for step in (0, 1):
        assert len({u for u, done in asked if done == step}) >= 2, asked


def test_a_unit_backward_let_go_is_kept_in_ram_for_its_step_and_its_gradient_freed_after(tmp_path):
    """Released after its backward, a unit's values are next read by the optimizer worker, not
    by the next forward (the trace's next use): the store is told they are needed soon, and once
    stepped during backward that they are needed last (issue 7: the worker read them from NVMe
    again, 0.7 of 8.35 GB/step on the 294M GPT). Its gradient is let go as soon as it is stepped,
    not at the end of the step (peak RSS 2.80 -> 2.23 GB there)."""
    model, reference, data = mlp(), mlp(), mlp_batches(3)
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme"))
    log = []
    set_next_use, step_unit = engine.store.set_next_use, engine.optimizer.step_unit

    def spy_hints(hints):
        log.extend(("hint", k, d) for k, d in hints.items())
        set_next_use(hints)

    def spy_step(u, grad, **kw):
        key = engine.optimizer.units[u].values_key
        log.append(("step", key, engine.store.clock))
        step_unit(u, grad, **kw)

    engine.store.set_next_use, engine.optimizer.step_unit = spy_hints, spy_step
    losses = []
    for args, kwargs in data:
        loss = loss_of(engine(*args, **kwargs))
        engine.backward(loss)
        for i in range(len(engine.ranked.trained)):  # units handed to the worker in backward
            future = engine._stepper.future(i)
            if future is not None:
                future.result()
                assert not engine.ranked.trained[i].grad.has_grad  # freed before step() is called
        engine.step()
        losses.append(loss.item())
    assert engine.units_stepped_in_backward > 0
    engine.close()
    assert_parity(model, reference, losses, train_reference(reference, data))
    steps = [n for n, (kind, _, _) in enumerate(log) if kind == "step"]
    for n in steps:
        key = log[n][1]
        last_hint = next(d for kind, k, d in reversed(log[:n]) if kind == "hint" and k == key)
        assert last_hint < 100, (key, last_hint)  # needed soon (the trace says: next forward)
    after = [next((d for kind, k, d in log[n + 1:] if kind == "hint" and k == log[n][1]), None)
             for n in steps]
    assert math.inf in after  # stepped during backward: needed last


def test_overlap_optimizer_steps_the_same_during_or_after_backward(tmp_path):
    """Nothing on NVMe: "auto" steps after backward on the CPU (during it on an accelerator);
    asked for, the units are stepped during backward; the result is the same bit for bit."""
    data, runs = mlp_batches(2), {}
    for asked in ("auto", True, False):
        model = mlp()
        engine = infinity.initialize(model, config(tmp_path, "cpu", "cpu", infinity={
            "host_memory_budget": "1GB", "overlap_optimizer": asked}))
        overlaps = asked is True or (asked == "auto" and engine.device.type != "cpu")
        assert engine.overlap is overlaps
        losses = train_engine(engine, data)
        assert engine.units_stepped_in_backward == (6 if overlaps else 0)
        engine.close()
        runs[asked] = model, losses
    after, after_losses = runs[False]
    reference = mlp()
    assert_parity(after, reference, after_losses, train_reference(reference, data))
    for asked in ("auto", True):
        assert_identical(*runs[asked], (after_losses, dict(after.named_parameters())))


def _hold_the_worker(engine, fail=()):
    """The optimizer worker is slower than backward, deterministically: it steps no unit of a
    step before the next forward begins (or something waits for the step: synchronize). So
    step() returns with every unit of the step still to step, the first one held in its step
    while the next forward starts. The units in `fail` raise OSError on their first step."""
    step_unit, failing = engine.optimizer.step_unit, set(fail)
    go = threading.Event()
    synchronize = engine.synchronize

    def held_step_unit(u, grad, **kw):
        assert go.wait(timeout=60), "neither a forward nor synchronize came to release the worker"
        if u in failing:
            failing.discard(u)
            raise OSError(f"injected failure stepping unit {u}")
        return step_unit(u, grad, **kw)

    def synchronize_then_hold():  # backward calls it first: its step's units are held again
        go.set()
        synchronize()
        go.clear()

    engine.optimizer.step_unit = held_step_unit
    engine.synchronize = synchronize_then_hold
    engine.module.register_forward_pre_hook(lambda module, args: go.set(), prepend=True)


def test_the_steps_tail_runs_into_the_next_forward(tmp_path):
    """[Note: the step's tail in the next forward]: step() returns with the first layers still
    to step; the next forward waits for each before using it; a WarmupLR schedule moves on at
    step() while the tail still steps with the step's own lr; the result is plain PyTorch's."""
    model, reference, data = mlp(), mlp(), mlp_batches(4)
    schedule = {"type": "WarmupLR", "params": {"warmup_min_lr": LR / 10, "warmup_max_lr": LR,
                                               "warmup_num_steps": 3, "warmup_type": "linear"}}
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme", scheduler=schedule))
    _hold_the_worker(engine)
    losses, lrs = [], []
    for args, kwargs in data:
        lrs.append(engine.get_lr()[0])
        losses += train_engine(engine, [(args, kwargs)])
    stats = engine.stats()
    regions = engine.timeline.regions
    engine.close()
    assert (stats["optimizer"]["units_left_to_forward"] > 0
            and stats["prefetch"]["after_optimizer"] > 0)
    forwards = [r.start for r in regions if r.name == "forward"]
    assert any(r.end > forwards[1] for r in regions
               if r.lane == "optimizer" and r.start < forwards[1])
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    ref_losses = []
    for lr, (args, kwargs) in zip(lrs, data):
        opt.param_groups[0]["lr"] = lr
        loss = loss_of(reference(*args, **kwargs))
        loss.backward()
        ref_losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    assert lrs[1] < lrs[2] < lrs[3]  # the schedule moved on while the tails ran
    assert_parity(model, reference, losses, ref_losses)
    after = stepped_after_backward(mlp(), tmp_path, data, scheduler=schedule)
    assert_identical(model, losses, after)


def test_the_tail_with_gradient_accumulation_matches_pytorch(tmp_path):
    """The first micro-batch of the next step waits for the tail before its gradients are
    taken (they accumulate into autograd's tensors, HeldGrad, only after the step let them go)."""
    model, reference, data = mlp(), mlp(), mlp_batches(6)
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme",
                                               gradient_accumulation_steps=2))
    _hold_the_worker(engine)
    losses = train_engine(engine, data)
    assert engine.global_steps == 3 and engine.stats()["optimizer"]["units_left_to_forward"] > 0
    engine.close()
    assert_parity(model, reference, losses, train_reference(reference, data, gas=2))
    assert_identical(model, losses, stepped_after_backward(mlp(), tmp_path, data,
                                                           gradient_accumulation_steps=2))


def test_a_tail_unit_that_failed_on_the_worker_is_stepped_again_before_its_use(tmp_path):
    """Unit 0 is stepped last (backward makes it final last) and fails once on the worker: the
    next forward steps it again before using it; nothing is lost or stepped twice."""
    model, reference, data = mlp(), mlp(), mlp_batches(3)
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme"))
    _hold_the_worker(engine, fail={0})
    losses = train_engine(engine, data)
    engine.close()
    assert_parity(model, reference, losses, train_reference(reference, data))
    assert_identical(model, losses, stepped_after_backward(mlp(), tmp_path, data))


def test_a_tail_unit_that_keeps_failing_fails_the_next_forward_until_it_steps(tmp_path):
    """The forward raises the unit's error; once the disk is back, the next call steps it and
    training goes on as if nothing happened."""
    model, reference, data = mlp(), mlp(), mlp_batches(2)
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme"))
    (x,), _ = data[0]
    real, calls = engine.optimizer.step_unit, []

    def disk_gone_for_unit_0(u, grad, **kw):
        if u == 0:
            calls.append(u)
            raise OSError("disk gone")
        return real(u, grad, **kw)

    engine.optimizer.step_unit = disk_gone_for_unit_0
    _hold_the_worker(engine)  # backward ends before the worker reaches unit 0
    loss = engine(x).square().mean()
    engine.backward(loss)
    engine.step()
    with pytest.raises(OSError, match="disk gone"):
        engine(x)
    assert len(calls) == 2  # on the worker, then again before the forward used it
    engine.optimizer.step_unit = real
    losses = [loss.item(), *train_engine(engine, data[1:])]
    engine.close()
    assert_parity(model, reference, losses, train_reference(reference, data))
    assert_identical(model, losses, stepped_after_backward(mlp(), tmp_path, data))


def test_with_clipping_the_optimizer_runs_after_backward(tmp_path):
    engine = infinity.initialize(mlp(), config(tmp_path, "cpu", "cpu", gradient_clipping=1.0))
    assert not engine.overlap
    train_engine(engine, mlp_batches(2))
    regions = engine.timeline.regions
    engine.close()
    backwards = sorted((r.start, r.end) for r in regions if r.name == "backward")
    steps = [r.start for r in regions if r.lane == "optimizer"]
    assert len(backwards) == 2 and len(steps) == 2 * len(engine.optimizer.units)
    for n, (start, end) in enumerate(backwards):  # each step's units after its own backward
        following = backwards[n + 1][0] if n + 1 < len(backwards) else math.inf
        own = [s for s in steps if start <= s < following]
        assert len(own) == len(engine.optimizer.units) and min(own) >= end, (n, own, end)


def test_a_failed_initialize_leaves_the_model_as_it_was(tmp_path, monkeypatch):
    model = mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}

    def broken(*args, **kwargs):
        raise RuntimeError("optimizer could not be built")

    monkeypatch.setattr("infinity.engine._engine.SwappedOptimizer", broken)
    with pytest.raises(RuntimeError, match="could not be built"):
        infinity.initialize(model, config(tmp_path, "nvme", "none"))
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), before[name]) and not p._post_accumulate_grad_hooks
    assert all(not m._forward_pre_hooks for m in model.modules())


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_matches_pytorch(tmp_path, reentrant):
    """Hugging Face gradient checkpointing recomputes forwards inside backward (and the
    non-reentrant kind stops a recompute early by raising): values stay right, bit for bit
    those of the same training without it, and nothing leaks."""
    model = llama()
    reference = copy.deepcopy(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    data = llama_batches(4)
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme"))
    losses = train_engine(engine, data)
    engine.close()
    plain = llama()
    engine = infinity.initialize(plain, config(tmp_path, "nvme", "nvme"))
    plain_losses = train_engine(engine, data)
    engine.close()
    assert_identical(model, losses, (plain_losses, dict(plain.named_parameters())))
    assert_parity(model, reference, losses, train_reference(reference, data))


def test_generate_runs_on_the_trained_values_without_on_demand_fetches(tmp_path):
    model = llama()
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme"))
    train_engine(engine, llama_batches(1))
    after_training = engine.stats()["prefetch"]["on_demand"]
    ids = torch.randint(0, 48, (1, 5), generator=torch.Generator().manual_seed(2))
    engine.eval()
    with torch.no_grad():
        generated = engine.module.generate(ids, max_new_tokens=6, do_sample=False)
    assert engine.stats()["prefetch"]["on_demand"] == after_training
    engine.close()
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), generated)


def test_a_schedule_without_its_total_steps_fails_before_anything_moves(tmp_path):
    model = mlp()
    with pytest.raises(ConfigError, match="total_num_steps"):
        infinity.initialize(model, config(tmp_path, scheduler={"type": "WarmupDecayLR",
                                                               "params": {"warmup_num_steps": 2}}))
    assert all(p.numel() > 0 for p in model.parameters())


def test_auto_batch_sizes_come_from_the_first_batch_and_progress_is_logged(tmp_path, caplog):
    cfg = config(tmp_path, train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps=2,
                 steps_per_print=1)
    engine = infinity.initialize(mlp(), cfg)
    assert engine.config.batch_pending
    with caplog.at_level("INFO", logger="infinity.engine"):
        train_engine(engine, mlp_batches(2))
    assert engine.config.train_micro_batch_size_per_gpu == 2 and engine.config.train_batch_size == 4
    assert "step 1: lr" in caplog.text
    engine.close()
