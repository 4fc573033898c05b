"""infinity.deepspeed's API beyond the getting-started script: the client optimizer taken over
(groups' weight decay, Adam's L2 mode) or refused, LR schedulers (callable, config, manual lr),
the training loader, DeepSpeed's checkpoint options, save_16bit_model, GatheredParameters,
zero.Init, add_config_arguments, init_distributed, what is refused, and save_pretrained of a
model in the store."""

import argparse
import copy
import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import transformers

import infinity
import infinity.deepspeed as deepspeed

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_engine import llama  # noqa: E402

STEPS = 4


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 10)
        self.norm = torch.nn.LayerNorm(10)
        self.b = torch.nn.Linear(10, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.norm(self.a(x)))).pow(2).mean()


def _groups(net: torch.nn.Module, decay: float = 0.3) -> list[dict]:
    weights = [net.a.weight, net.b.weight]
    return [
        {"params": weights, "weight_decay": decay},
        {
            "params": [p for p in net.parameters() if all(p is not w for w in weights)],
            "weight_decay": 0.0,
        },
    ]


def _config(tmp_path=None, **extra) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if tmp_path is not None:
        offload = {"device": "nvme", "nvme_path": str(tmp_path)}
        zero.update(offload_param=offload, offload_optimizer=offload)
    return {"train_micro_batch_size_per_gpu": 3, "zero_optimization": zero, **extra}


def _batches(n: int = STEPS) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(3, 6, generator=g) for _ in range(n)]


def _train_plain(net, optimizer, scheduler=None):
    for x in _batches():
        net(x).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()


def _train(engine):
    for x in _batches():
        engine.backward(engine(x))
        engine.step()
    return dict(engine.named_parameters())


def _assert_same(params, net, rtol=1e-5):
    for name, p in net.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), rtol=rtol, atol=1e-7)


@pytest.mark.parametrize("kind", [torch.optim.AdamW, torch.optim.Adam])
def test_a_client_optimizer_is_taken_over_with_its_groups(tmp_path, kind):
    torch.manual_seed(0)
    ref = Net()
    net = copy.deepcopy(ref)
    _train_plain(ref, kind(_groups(ref), lr=0.05, betas=(0.8, 0.95), eps=1e-6))
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        model=net,
        optimizer=kind(_groups(net), lr=0.05, betas=(0.8, 0.95), eps=1e-6),
        config=_config(tmp_path),
    )
    assert loader is None and scheduler is None
    assert (
        isinstance(optimizer, torch.optim.Optimizer)
        and optimizer.param_groups[0]["weight_decay"] == 0.3
    )
    _assert_same(
        _train(engine), ref
    )  # one decay for all (0.3 or 0) would be far off for norm and biases
    engine.close()


def test_a_callable_scheduler_moves_the_lr_of_every_update_and_is_returned(tmp_path):
    torch.manual_seed(0)
    ref = Net()
    net = copy.deepcopy(ref)
    opt = torch.optim.AdamW(
        ref.parameters(), lr=0.1, weight_decay=0.0
    )  # the config's default decay
    _train_plain(ref, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=net,
        model_parameters=net.parameters(),
        config=_config(optimizer={"type": "AdamW", "params": {"lr": 0.1}}),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    )
    assert (
        isinstance(scheduler, torch.optim.lr_scheduler.StepLR) and scheduler.optimizer is optimizer
    )
    _assert_same(_train(engine), ref)
    assert engine.get_lr() == [0.1 * 0.5**STEPS] == scheduler.get_last_lr()
    with pytest.raises(RuntimeError, match="engine.step"):
        optimizer.step()
    engine.close()


def test_the_config_scheduler_and_a_manual_lr(tmp_path):
    engine, optimizer, _, scheduler = deepspeed.initialize(
        model=Net(),
        config=_config(
            optimizer={"type": "AdamW", "params": {"lr": 0.1}},
            scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 2, "warmup_max_lr": 0.1}},
        ),
    )
    _train(engine)
    assert (
        scheduler.get_last_lr()
        == engine.get_lr()
        == [0.1]
        == [g["lr"] for g in optimizer.param_groups]
    )
    with pytest.raises(RuntimeError, match="engine steps"):
        scheduler.step()
    engine.close()
    # No scheduler: the group's lr, changed by the caller, is the next update's.
    torch.manual_seed(0)
    ref = Net()
    net = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    engine, optimizer, _, _ = deepspeed.initialize(
        model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=0.1), config=_config()
    )
    for x in _batches():
        ref(x).backward()
        opt.step()
        opt.zero_grad()
        engine.backward(engine(x))
        engine.step()
        for group in (*opt.param_groups, *optimizer.param_groups):
            group["lr"] /= 3
    _assert_same(dict(engine.named_parameters()), ref)
    engine.close()


@pytest.mark.parametrize(
    "optimizer, match",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1), "torch.optim.Adam or torch.optim.AdamW"),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1, amsgrad=True), "amsgrad"),
        (
            lambda ps: torch.optim.AdamW(
                [{"params": ps[:2], "lr": 0.2}, {"params": ps[2:]}], lr=0.1
            ),
            "differ in lr",
        ),
        (
            lambda ps: torch.optim.AdamW(ps[1:], lr=0.1),
            "'a.weight' requires grad but is in no optimizer group",
        ),
    ],
)
def test_an_optimizer_the_engine_cannot_run_is_refused(optimizer, match):
    net = Net()
    with pytest.raises((TypeError, ValueError), match=match):
        deepspeed.initialize(
            model=net, optimizer=optimizer(list(net.parameters())), config=_config()
        )
    assert net.a.weight.numel() == 60  # refused before anything moved


def test_what_initialize_refuses():
    net = Net()
    stepped = torch.optim.AdamW(net.parameters())
    net(torch.randn(2, 6)).backward()
    stepped.step()
    with pytest.raises(ValueError, match="already stepped"):
        deepspeed.initialize(model=net, optimizer=stepped, config=_config())
    with pytest.raises(NotImplementedError, match="model parallelism"):
        deepspeed.initialize(model=net, config=_config(), mpu=object())
    with pytest.raises(ValueError, match="two DeepSpeed configs"):
        deepspeed.initialize(
            args=argparse.Namespace(deepspeed_config="x.json"), model=net, config=_config()
        )
    with pytest.raises(ValueError, match="no DeepSpeed config"):
        deepspeed.initialize(model=net)
    opt = torch.optim.AdamW(net.parameters())
    with pytest.raises(ValueError, match="needs the optimizer it was built on"):
        deepspeed.initialize(
            model=net, config=_config(), lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1)
        )
    with pytest.raises(ValueError, match="groups may differ in weight_decay only"):
        deepspeed.initialize(
            model=net,
            config=_config(),
            model_parameters=[{"params": list(net.parameters()), "lr": 5.0}],
        )
    assert net.a.weight.numel() == 60


def test_accepted_but_not_done_is_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="infinity.deepspeed"):
        engine, *_ = deepspeed.initialize(
            model=Net(),
            config=_config(
                pipeline={"stages": 2}, tensorboard={"enabled": True, "output_path": "tb"}
            ),
        )
    engine.close()
    lines = [r.getMessage() for r in caplog.records if "accepted, not done" in r.getMessage()]
    assert len(lines) == 1 and "pipeline" in lines[0] and "tensorboard" in lines[0]


def test_the_training_loader_gives_micro_batches_in_the_same_order_every_time():
    data = torch.utils.data.TensorDataset(torch.arange(20.0).reshape(10, 2))
    orders = []
    for _ in range(2):
        torch.manual_seed(0)
        engine, _, loader, _ = deepspeed.initialize(
            model=Net(), config=_config(), training_data=data
        )
        orders.append([batch[0][:, 0].tolist() for batch in loader])
        engine.close()
    assert orders[0] == orders[1] and [len(b) for b in orders[0]] == [3, 3, 3, 1]
    assert sorted(v for b in orders[0] for v in b) == [float(2 * i) for i in range(10)]
    assert orders[0][0] != [0.0, 2.0, 4.0]  # shuffled, as DeepSpeed's sampler does
    with pytest.raises(ValueError, match="map-style"):
        deepspeed.initialize(model=Net(), config=_config(), training_data=iter([1, 2]))


def _halving(seed: int) -> tuple:
    """An engine over a new Net (initialised from `seed`), a client AdamW halving its lr."""
    torch.manual_seed(seed)
    net = Net()
    return deepspeed.initialize(
        model=net,
        optimizer=torch.optim.AdamW(net.parameters(), lr=0.1),
        config=_config(),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
    )


def test_checkpoint_options_as_deepspeed(tmp_path):
    engine, optimizer, _, _ = _halving(0)
    assert engine.load_checkpoint(tmp_path / "none") == (None, None)
    trained = _train(engine)
    assert engine.save_checkpoint(tmp_path / "run", client_state={"x": 1}) is True
    assert (tmp_path / "run" / f"global_step{STEPS}").is_dir()
    assert (tmp_path / "run" / "latest").read_text().strip() == f"global_step{STEPS}"
    engine.save_checkpoint(tmp_path / "run", tag="side", save_latest=False)
    assert (tmp_path / "run" / "latest").read_text().strip() == f"global_step{STEPS}"

    fresh, fresh_opt, _, fresh_sched = _halving(1)
    path, client_state = fresh.load_checkpoint(tmp_path / "run", load_module_only=True)
    assert path == str(tmp_path / "run" / f"global_step{STEPS}") and client_state == {"x": 1}
    assert fresh.global_steps == 0 and fresh.get_lr() == [0.1]  # values only
    assert all(torch.equal(v, trained[n]) for n, v in fresh.named_parameters())
    fresh.load_checkpoint(tmp_path / "run", load_lr_scheduler_states=False)
    assert fresh.global_steps == STEPS and fresh.get_lr() == [0.1] and fresh_sched.last_epoch == 0
    fresh.load_checkpoint(tmp_path / "run")
    assert (
        fresh.get_lr() == engine.get_lr() == [0.1 * 0.5**STEPS] and fresh_sched.last_epoch == STEPS
    )
    assert [g["lr"] for g in fresh_opt.param_groups] == [g["lr"] for g in optimizer.param_groups]
    with pytest.raises(NotImplementedError, match="custom_load_fn"):
        fresh.load_checkpoint(tmp_path / "run", custom_load_fn=print)
    engine.close()
    fresh.close()


def test_save_16bit_model_streams_a_torch_file_for_the_module_class(tmp_path):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=20, n_positions=8)
    )
    engine, *_ = deepspeed.initialize(model=model, config=_config(tmp_path, bf16={"enabled": True}))
    engine.backward(engine(torch.randint(0, 20, (3, 8)), labels=torch.randint(0, 20, (3, 8))).loss)
    engine.step()
    values = dict(engine.named_parameters())
    assert engine.save_16bit_model(tmp_path / "out", "model.bin") is True
    saved = torch.load(tmp_path / "out" / "model.bin", weights_only=True)
    assert saved["lm_head.weight"].dtype == torch.bfloat16  # stored dtype; the tied head shares it
    assert saved["lm_head.weight"].data_ptr() == saved["transformer.wte.weight"].data_ptr()
    fresh = transformers.GPT2LMHeadModel(model.config).to(torch.bfloat16)
    fresh.load_state_dict(saved)  # strict: buffers and tied names included
    assert all(torch.equal(p, values[n]) for n, p in fresh.named_parameters())
    engine.close()


def test_gathered_parameters_read_and_write_the_store(tmp_path):
    torch.manual_seed(0)
    net = Net()
    expected = net.a.weight.detach().clone()
    free = torch.nn.Parameter(torch.ones(3))
    engine, *_ = deepspeed.initialize(model=net, config=_config(tmp_path))
    assert net.a.weight.numel() == 0
    with deepspeed.zero.GatheredParameters([net.a.weight, net.b.bias, free]):
        assert torch.equal(net.a.weight, expected)
        net.a.weight.data.zero_()  # no modifier rank: not written back
    assert net.a.weight.numel() == 0 and torch.equal(
        dict(engine.named_parameters())["a.weight"], expected
    )
    with deepspeed.zero.GatheredParameters(net.a.weight, modifier_rank=0):
        net.a.weight.data.fill_(2.0)
    assert torch.equal(dict(engine.named_parameters())["a.weight"], torch.full_like(expected, 2.0))
    engine.backward(engine(torch.randn(3, 6)))  # trains from the new values
    engine.step()
    with pytest.raises(ValueError, match="modifier_rank 1"):
        with deepspeed.zero.GatheredParameters(net.a.weight, modifier_rank=1):
            pass
    engine.close()
    bf16, *_ = deepspeed.initialize(model=Net(), config=_config(bf16={"enabled": True}))
    with pytest.raises(ValueError, match="fp32 master"):
        with deepspeed.zero.GatheredParameters(bf16.module.a.weight, modifier_rank=0):
            pass
    bf16.close()


def test_zero_init_builds_into_the_store():
    with deepspeed.zero.Init(config_dict_or_path=_config()):
        net = Net()
    assert net.a.weight.device.type == "meta"
    with pytest.raises(ValueError, match="meta device"):
        with deepspeed.zero.GatheredParameters(net.a.weight):
            pass
    engine, *_ = deepspeed.initialize(
        model=net, optimizer=torch.optim.AdamW(_groups(net), lr=0.1), config=_config()
    )
    with deepspeed.zero.GatheredParameters([net.a.weight, net.norm.weight]):
        assert net.a.weight.abs().sum() > 0 and torch.equal(net.norm.weight, torch.ones(10))
    _train(engine)
    engine.close()
    with pytest.raises(NotImplementedError, match="module="):
        deepspeed.zero.Init(module=Net())


def test_command_line_flags_and_a_process_group_of_one():
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json" and args.deepscale_config is None
    assert deepspeed.checkpointing.checkpoint is infinity.recompute.run


def test_init_distributed_without_torchrun_starts_a_group_of_one(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()  # (else init_distributed would rightly do nothing)
    try:
        deepspeed.init_distributed()
        deepspeed.init_distributed()  # a group exists: nothing
        assert (dist.get_world_size(), dist.get_rank(), dist.get_backend()) == (1, 0, "gloo")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_save_pretrained_of_a_model_in_the_store_writes_its_values(tmp_path):
    model = llama()  # the engine tests' tiny Llama: 2 layers, tied head, vocabulary 48
    engine = infinity.initialize(model, _config(tmp_path))
    engine.backward(engine(torch.randint(0, 48, (3, 6)), labels=torch.randint(0, 48, (3, 6))).loss)
    engine.step()
    values = dict(engine.named_parameters())
    model.save_pretrained(tmp_path / "out", max_shard_size=4000)  # several shards and an index
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(p, values[n]) for n, p in loaded.named_parameters() if n in values)
    x = torch.randint(0, 48, (2, 5))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, model(x).logits)
    with pytest.raises(ValueError, match="state_dict"):
        model.save_pretrained(tmp_path / "x", state_dict={})
    engine.close()
    model.save_pretrained(tmp_path / "after")  # the model's own method once its values are back
    assert torch.equal(
        transformers.LlamaForCausalLM.from_pretrained(tmp_path / "after").lm_head.weight,
        values["model.embed_tokens.weight"],
    )
