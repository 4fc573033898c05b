"""infinity.recompute without the engine: recompute gives the gradients of the plain forward,
the host copies of cpu_checkpointing (mechanism checked on the CPU with a copy standing in for
the device move), configure's DeepSpeed signature, and the profile / sync settings."""

import gc
import logging
import weakref

import pytest
import torch

from infinity import ConfigError, recompute
from infinity.config import ActivationCheckpointingConfig
from infinity.recompute._host import HostCopy, HostOffload
from infinity.recompute._run import run_with


@pytest.fixture(autouse=True)
def _fresh_settings():
    recompute.reset()
    yield
    recompute.reset()


def block() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 24), torch.nn.GELU(), torch.nn.Dropout(0.2),
                               torch.nn.Linear(24, 6))


def grads_of(fn, x, module):
    """Loss, input gradient and parameter gradients of sum(fn(x)^2), with a fixed RNG."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(x.requires_grad)
    torch.manual_seed(5)
    loss = fn(x).square().sum()
    loss.backward()
    return [loss.detach(), x.grad, *(p.grad for p in module.parameters())]


def assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
        else:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("reentrant", [False, True])
def test_run_gives_the_gradients_of_the_plain_forward_dropout_included(reentrant):
    m = block()
    x = torch.randn(5, 6, requires_grad=True)
    want = grads_of(m, x, m)
    assert_same(grads_of(lambda t: recompute.run(m, t, use_reentrant=reentrant), x, m), want)


def test_host_copies_hold_the_saved_inputs_and_free_the_originals():
    """The mechanism of cpu_checkpointing, with the CPU as 'device': pack copies, the caller's
    tensor is no longer kept by the graph, backward reads the copy, gradients are unchanged."""
    m = block()
    x = torch.randn(5, 6, requires_grad=True)
    want = grads_of(m, x, m)
    offload = HostOffload(torch.device("cpu"), pin=False)
    got = grads_of(lambda t: run_with(m, (t,), use_reentrant=True, offload=offload), x, m)
    assert_same(got, want)
    assert offload.parked_bytes == x.numel() * 4

    def forward_only(offload):
        h = torch.nn.functional.linear(x, torch.eye(6))  # an activation, as a block's input is
        alive = weakref.ref(h)
        out = run_with(m, (h,), use_reentrant=True, offload=offload)
        del h
        gc.collect()
        return alive() is not None, out

    kept, _ = forward_only(None)
    assert kept, "without host copies the graph keeps the input"
    kept, out = forward_only(HostOffload(torch.device("cpu"), pin=False))
    assert not kept, "with host copies only the copy is kept"
    out.sum().backward()  # the copy comes back for the recompute


def test_host_copies_give_parameter_gradients_when_no_input_requires_grad():
    m = block()
    x = torch.randn(5, 6)
    want = grads_of(m, x, m)
    offload = HostOffload(torch.device("cpu"), pin=False)
    got = grads_of(lambda t: run_with(m, (t,), use_reentrant=True, offload=offload), x, m)
    assert_same(got, want)


def test_pack_leaves_tensors_of_other_devices_and_unpack_restores_the_device():
    offload = HostOffload(torch.device("meta"), pin=False)
    cpu = torch.ones(3)
    assert offload.pack(cpu) is cpu and offload.unpack(cpu) is cpu
    back = offload.unpack(HostCopy(torch.ones(4, 2), torch.device("meta")))
    assert back.device.type == "meta" and back.shape == (4, 2) and offload.parked_bytes == 0


def test_configure_takes_deepspeeds_signature_and_logs_what_has_no_effect(caplog):
    assert not recompute.is_configured()
    with caplog.at_level(logging.INFO, logger="infinity.recompute"):
        got = recompute.configure(object(), deepspeed_config={"activation_checkpointing": {
            "partition_activations": True, "contiguous_memory_optimization": True,
            "number_checkpoints": 4, "cpu_checkpointing": False}}, checkpoint_in_cpu=True,
            profile=True)
    assert recompute.is_configured() and got == recompute.settings()
    assert got.cpu_checkpointing and got.profile and got.partition_activations
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1
    for name in ("mpu_", "partition_activations", "contiguous_memory_optimization",
                 "number_checkpoints"):
        assert name in lines[0]
    if not torch.cuda.is_available():
        assert "cpu_checkpointing (compute is on the CPU" in lines[0]
    recompute.reset()
    assert recompute.settings() == ActivationCheckpointingConfig()


def test_configure_rejects_what_it_cannot_read():
    with pytest.raises(TypeError, match="deepspeed_config"):
        recompute.configure(None, deepspeed_config=3)
    with pytest.raises(ConfigError, match="number_checkpoints"):
        recompute.configure(None, deepspeed_config={
            "activation_checkpointing": {"number_checkpoints": 0}})
    with pytest.raises(ConfigError, match="activation_checkpointing.cpu_checkpoint"):
        recompute.configure(None, deepspeed_config={
            "activation_checkpointing": {"cpu_checkpoint": True}})


def test_cpu_checkpointing_on_cpu_tensors_changes_nothing(monkeypatch):
    recompute.configure(None, checkpoint_in_cpu=True)
    seen = []
    monkeypatch.setattr("infinity.recompute._run.run_with",
                        lambda f, a, **kw: seen.append(kw["offload"]) or f(*a))
    recompute.run(torch.sin, torch.ones(2))
    assert seen == [None]


@pytest.mark.parametrize("profile", [False, True])
def test_profile_times_forward_runs_and_recomputes(profile, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda: pytest.fail("no accelerator to synchronise"))
    recompute.configure(None, profile=profile, synchronize=True)
    m = block()
    for _ in range(2):
        recompute.run(m, torch.randn(5, 6, requires_grad=True)).sum().backward()
    t = recompute.timings()
    if profile:
        assert ((t["calls"], t["recomputes"]) == (2, 2) and t["forward_s"] > 0
                and t["recompute_s"] > 0)
    else:
        assert t == {"calls": 0, "forward_s": 0.0, "recomputes": 0, "recompute_s": 0.0}


@pytest.mark.requires_cuda
def test_cpu_checkpointing_keeps_block_inputs_in_pinned_host_memory_on_cuda():
    """On an accelerator: the same gradients, every saved input is pinned host memory, and the
    device memory held between forward and backward drops by the inputs' size."""
    torch.manual_seed(0)
    blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU())
                                 for _ in range(8)).cuda()
    x = torch.randn(4096, 256, device="cuda", requires_grad=True)

    def run(cpu: bool):
        recompute.configure(None, checkpoint_in_cpu=cpu, synchronize=True)
        for b in blocks:
            b.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        h = x
        for b in blocks:
            h = recompute.run(b, h)
        held = torch.cuda.memory_allocated() - base
        h.square().sum().backward()
        return held, [p.grad.clone() for p in blocks.parameters()]

    held_device, want = run(False)
    held_host, got = run(True)
    assert_same(got, want)
    assert held_host < held_device - 6 * 4096 * 256 * 4, (held_host, held_device)
