"""Engine.save_checkpoint / load_checkpoint: a resumed run ends with exactly the weights of an
uninterrupted one (fp32 and bf16, optimizer state in RAM or on NVMe, fp16 loss scaling, LR
schedule); client_state comes back; a checkpoint without moments needs an explicit choice."""

import inspect
import json

import pytest
import torch
import transformers
from children import python_child

import infinity
from infinity import CheckpointError
from infinity.checkpoint import CheckpointReader, CheckpointWriter


def mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                               torch.nn.Linear(32, 4))


def config(swap, optimizer, **extra):
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "scheduler": {"type": "WarmupLR",
                          "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "sub_group_size": 64, "offload_param": {"device": "none"},
                                  "offload_optimizer": {"device": optimizer,
                                                        "nvme_path": str(swap)}},
            "infinity": {"host_memory_budget": "1GB"}, **extra}


def train(engine, steps):
    for _ in range(steps):
        # drawn from the RNG the checkpoint restores
        x = torch.randn(2, 8).to(engine.precision.compute)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()


@pytest.mark.parametrize("optimizer", ["none", "nvme"])
@pytest.mark.parametrize("precision", [{}, {"bf16": {"enabled": True}},
                                       {"fp16": {"enabled": True, "initial_scale_power": 4}}],
                         ids=["fp32", "bf16", "fp16"])
def test_a_resumed_run_ends_bit_identical(tmp_path, optimizer, precision):
    swap = tmp_path / "swap"
    swap.mkdir()
    engine = infinity.initialize(mlp(0), config(swap, optimizer, **precision))
    torch.manual_seed(1)
    train(engine, 3)
    path = engine.save_checkpoint(tmp_path / "run", client_state={"batch": 3})
    train(engine, 4)
    expected = dict(engine.named_parameters())
    expected_state = (engine.global_steps, engine.get_lr(), engine.stats()["loss_scale"])
    engine.close()
    assert path == tmp_path / "run" / "step3"

    resumed = infinity.initialize(mlp(99), config(swap, optimizer, **precision))  # other weights
    torch.manual_seed(12345)  # other RNG state: the checkpoint's must win
    assert resumed.load_checkpoint(tmp_path / "run") == {"batch": 3}
    assert resumed.global_steps == 3
    train(resumed, 4)
    got = dict(resumed.named_parameters())
    assert (resumed.global_steps, resumed.get_lr(), resumed.stats()["loss_scale"]) == expected_state
    resumed.close()
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_the_checkpoint_holds_weights_masters_and_moments_by_name(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    engine = infinity.initialize(mlp(0), config(swap, "nvme", bf16={"enabled": True}))
    train(engine, 2)
    engine.save_checkpoint(tmp_path / "run", tag="mine")
    engine.close()
    reader = CheckpointReader(tmp_path / "run")
    assert reader.tag == "mine"
    assert (reader.dtype("0.weight") == torch.bfloat16
            and reader.dtype("master/0.weight") == torch.float32)
    assert reader.shape("exp_avg_sq/3.bias") == (4,)
    assert (reader.metadata["engine"]["global_steps"] == 2
            and reader.metadata["engine"]["optimizer_step"] == 2)
    reader.verify()


def test_a_checkpoint_without_moments_loads_only_when_asked(tmp_path, caplog):
    swap = tmp_path / "swap"
    swap.mkdir()
    model = mlp(5)
    with CheckpointWriter(tmp_path / "weights", "w") as writer:
        for name, p in model.named_parameters():
            writer.add(name, p.detach())
    engine = infinity.initialize(mlp(0), config(swap, "none"))
    with pytest.raises(CheckpointError, match="no Adam moments.*load_optimizer_states=False"):
        engine.load_checkpoint(tmp_path / "weights")
    engine.load_checkpoint(tmp_path / "weights", load_optimizer_states=False)
    assert "starts from zero moments" in caplog.text
    got = dict(engine.named_parameters())
    engine.close()
    for name, p in model.named_parameters():
        assert torch.equal(got[name], p.detach()), name


def test_a_checkpoint_of_another_model_is_refused_naming_the_parameter(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    with CheckpointWriter(tmp_path / "other", "w") as writer:
        writer.add("0.weight", torch.zeros(3, 3))
    engine = infinity.initialize(mlp(0), config(swap, "none"))
    with pytest.raises(CheckpointError,
                       match=r"'0.weight' has shape \(3, 3\), the model's is \(32, 8\)"):
        engine.load_checkpoint(tmp_path / "other")
    engine.close()


def test_an_fp32_checkpoint_resumes_in_a_bf16_run_with_fp32_masters(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    engine = infinity.initialize(mlp(0), config(swap, "nvme"))
    train(engine, 2)
    engine.save_checkpoint(tmp_path / "run")
    fp32 = dict(engine.named_parameters())
    engine.close()
    bf16 = infinity.initialize(mlp(3), config(swap, "nvme", bf16={"enabled": True}))
    bf16.load_checkpoint(tmp_path / "run")
    assert {n: t.dtype for n, t in bf16.named_parameters()} == {n: torch.bfloat16 for n in fp32}
    assert all(torch.equal(t, fp32[n].bfloat16()) for n, t in bf16.named_parameters())
    # the master keeps the fp32 values, not their rounding
    state = dict(bf16.optimizer.iter_state())
    flat = torch.cat([fp32[s.name].reshape(-1) for s in bf16.ranked.trained[0].slots])
    assert torch.equal(state[0]["master"].reshape(-1)[:flat.numel()], flat)
    train(bf16, 1)
    bf16.close()


def test_a_background_save_holds_the_state_of_its_call(tmp_path):
    """Training goes on while the save is written (4 KiB of copies queued at most); the
    checkpoint still resumes to the uninterrupted run's weights."""
    swap = tmp_path / "swap"
    swap.mkdir()
    engine = infinity.initialize(mlp(0), config(swap, "nvme", bf16={"enabled": True}))
    torch.manual_seed(1)
    train(engine, 3)
    assert engine.save_checkpoint(tmp_path / "run", async_save=True, async_budget_nbytes=4096) \
        == tmp_path / "run" / "step3"
    train(engine, 4)
    expected = dict(engine.named_parameters())
    engine.close()  # waits for the save
    resumed = infinity.initialize(mlp(7), config(swap, "nvme", bf16={"enabled": True}))
    resumed.load_checkpoint(tmp_path / "run")
    train(resumed, 4)
    got = dict(resumed.named_parameters())
    resumed.close()
    assert all(torch.equal(got[n], t) for n, t in expected.items())


def test_a_failed_background_save_is_raised_by_the_next_call(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()
    engine = infinity.initialize(mlp(0), config(swap, "none"))
    engine.save_checkpoint(tmp_path / "run", client_state={"x": object()}, async_save=True)
    with pytest.raises(CheckpointError, match="metadata must be JSON"):
        engine.wait_for_checkpoint()
    engine.close()
    assert not (tmp_path / "run" / "step0").exists()


def test_a_transformers_model_saved_by_the_engine_converts_to_hf_alone(tmp_path):
    """The engine keeps the model's config, so `infinity-convert --to hf` needs nothing else and
    from_pretrained gives the logits of the trained model."""
    from infinity.cli.convert import main

    cfg = transformers.LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=32, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    swap = tmp_path / "swap"
    swap.mkdir()
    engine = infinity.initialize(model, config(swap, "none"))
    ids = torch.randint(0, 48, (2, 8), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    engine.save_checkpoint(tmp_path / "run")
    engine.close()  # the model gets its trained values back
    assert main([str(tmp_path / "run"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model.eval()(ids).logits)


def test_frozen_and_resident_parameters_resume_too(tmp_path):
    swap = tmp_path / "swap"
    swap.mkdir()

    def build(seed):
        model = mlp(seed)
        model[0].weight.requires_grad_(False)
        cfg = config(swap, "nvme")
        cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 40  # biases stay resident
        return infinity.initialize(model, cfg)

    engine = build(0)
    torch.manual_seed(1)
    train(engine, 2)
    engine.save_checkpoint(tmp_path / "run")
    train(engine, 2)
    expected = dict(engine.named_parameters())
    assert (any(u.persistent for u in engine.units)
            and any(not u.requires_grad for u in engine.units))
    engine.close()
    resumed = build(4)
    resumed.load_checkpoint(tmp_path / "run")
    train(resumed, 2)
    got = dict(resumed.named_parameters())
    resumed.close()
    assert all(torch.equal(got[n], t) for n, t in expected.items())


def test_a_deepspeed_checkpoint_converted_to_infinity_resumes_with_weights_and_moments(tmp_path):
    """`infinity-convert --to infinity` of a 2-rank ZeRO-3 DeepSpeed checkpoint: load_checkpoint
    gives its fp32 weights and step count, and the next step is AdamW's from its moments at
    Adam step 7 (as DeepSpeed would go on)."""
    import deepspeed_layout

    from infinity.cli.convert import main

    def model():
        torch.manual_seed(5)  # other values than the checkpoint's
        return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))

    g = torch.Generator().manual_seed(3)
    weights = {name: torch.randn(p.shape, generator=g) for name, p in model().named_parameters()}
    deepspeed_layout.write(tmp_path / "ds", weights, stage=3, precision="fp32")
    assert main([str(tmp_path / "ds"), str(tmp_path / "run"), "--to", "infinity"]) == 0
    swap = tmp_path / "swap"
    swap.mkdir()
    cfg = config(swap, "nvme")
    del cfg["scheduler"]
    engine = infinity.initialize(model(), cfg)
    engine.load_checkpoint(tmp_path / "run")
    assert engine.global_steps == 7
    loaded = dict(engine.named_parameters())
    assert loaded.keys() == weights.keys()
    assert all(torch.equal(loaded[name], w) for name, w in weights.items())
    x = torch.randn(2, 8, generator=g)
    engine.backward(engine(x).square().mean())
    engine.step()
    got = dict(engine.named_parameters())
    engine.close()

    reference = model()
    reference.load_state_dict(weights)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    for name, p in reference.named_parameters():
        opt.state[p] = {"step": torch.tensor(7.0), **deepspeed_layout.moments(weights[name])}
    reference(x).square().mean().backward()
    opt.step()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(got[name], p.detach(), rtol=1e-5, atol=1e-7)


LOAD_CONFIG = {"train_micro_batch_size_per_gpu": 1,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
               "zero_optimization": {"stage": 3, "offload_param": {"device": "none"},
                                     "offload_optimizer": {"device": "none"}}}


def one_unit_of_96_mib() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(24 * 1024, 1024), torch.nn.Linear(1024, 16))


LOAD_CHILD = r"""
import json, sys
import torch
import infinity
def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
exec(sys.argv[1])  # one_unit_of_96_mib
engine = infinity.initialize(one_unit_of_96_mib(), json.loads(sys.argv[2]))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # reset the peak RSS (VmHWM) to what the engine holds before the load
base = kib("VmRSS")
engine.load_checkpoint(sys.argv[3])
print("GROWN", (kib("VmHWM") - base) * 1024)
engine.close()
"""


def test_a_load_holds_chunks_not_rows_or_copies_of_each_tensor(tmp_path):
    """Loading reads each tensor chunk by chunk into its destination (the unit's values, the
    optimizer's tiles, one tile's segment at a time): peak growth is the reader's chunks in
    flight and the allocator's slack, less than one fp32 row of the 96 MiB unit. Measured on
    the development machine: 51-59 MiB; with load_state taking the unit's 3 fp32 rows whole
    (the session before): 337 MiB; reading each tensor whole and then copying it: 432 MiB.
    The checkpoint is saved here; only the load, whose peak is measured, has a fresh child."""
    with infinity.initialize(one_unit_of_96_mib(), LOAD_CONFIG) as engine:
        engine.save_checkpoint(tmp_path / "run")
    out = python_child(["-c", LOAD_CHILD, inspect.getsource(one_unit_of_96_mib),
                        json.dumps(LOAD_CONFIG), str(tmp_path / "run")], timeout=300)
    assert out.returncode == 0, out.stderr
    grown = int(out.stdout.split("GROWN")[1])
    unit = 24 * 1024 * 1024 * 4
    assert grown <= unit, f"load grew {grown / (1 << 20):.0f} MiB"
