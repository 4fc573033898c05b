"""Engine parity: training through infinity.initialize equals plain PyTorch + torch.optim.AdamW
for every offload combination, with accumulation and clipping (non-finite gradients and fp16
overflow: test_engine_nonfinite.py; the optimizer overlapped with backward and the step's tail:
test_engine_overlap.py)."""

import copy
import json

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
    arriving = 2 * max(u.numel * 4 for u in engine.units if u.requires_grad)  # autograd's, fp32
    assert engine.plan.grads_tier is not None and engine.plan.outside_store_nbytes == arriving
    assert engine.plan.budgets[Tier.HOST] <= 240_000
    losses = train_engine(engine, data)
    assert all(isinstance(u.grad, StoredGrad) for u in engine.units if u.requires_grad)
    engine.close()
    assert_parity(model, reference, losses, train_reference(reference, data, gas=2))


def test_gradients_on_nvme_keep_the_dtype_of_bf16_values_computed_in_fp32(tmp_path):
    """bf16 values upcast to fp32 when fetched: gradients sent to NVMe are kept in bf16 (half
    the disk and traffic; [Note: memory plan]), summed over micro-batches there, and training
    still tracks the fp32 reference as bf16 does."""
    model = llama()
    reference = copy.deepcopy(model)
    data = llama_batches(2) * 10  # two batches again and again: the loss falls
    engine = infinity.initialize(model, config(
        tmp_path, "nvme", "nvme", lr=3e-3, gradient_accumulation_steps=2, bf16={"enabled": True},
        infinity={"host_memory_budget": 240_000, "compute_dtype": "fp32"}))
    assert engine.plan.grads_tier is Tier.NVME
    trained = [u for u in engine.units if u.requires_grad]
    assert {u.compute_dtype for u in trained} == {torch.float32}
    assert {u.grad.dtype for u in trained} == {torch.bfloat16}
    args, kwargs = data[0]
    engine.backward(loss_of(engine(*args, **kwargs)))  # the first of two micro-batches
    assert all(isinstance(u.grad, StoredGrad) and u.grad.has_grad for u in trained)
    with trained[0].grad.read() as grad:
        assert grad.dtype == torch.bfloat16 and grad.abs().sum() > 0
    engine.step()
    losses = train_engine(engine, data[1:])
    engine.close()
    ref_losses = train_reference(reference, data, gas=2, lr=3e-3)[1:]
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it learned something to track
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 0.01 * want, (losses, ref_losses)


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
    prefetch = engine.stats()["prefetch"]
    kept_while_open = engine.coordinator.upcasts.kept_bytes
    engine.close()
    assert engine.coordinator.upcasts.kept_bytes == 0  # a closed engine holds no copies
    assert (kept_while_open > 0) == (compute == "fp32")
    if compute == "bf16":
        assert prefetch["upcasts_reused"] == prefetch["upcasts_fresh"] == 0
    else:  # most upcast copies go into buffers kept from earlier uses (two of the largest
        # unit's, the embedding's, hold less than a layer's seven sizes here)
        assert prefetch["upcasts_reused"] > 2 * prefetch["upcasts_fresh"] > 0, prefetch
    ref_losses = train_reference(reference, data, lr=3e-3)
    assert ref_losses[-1] < ref_losses[0] - 0.1  # it learned something to track
    for got, want in zip(losses, ref_losses):
        assert abs(got - want) <= 0.01 * want, (losses, ref_losses)


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
