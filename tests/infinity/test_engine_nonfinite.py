"""Non-finite gradients: the fp16 overflow skips the step; in fp32 a step with an inf/nan
gradient is refused with nothing changed (after backward, or overlapped: the units stepped
during backward are rolled back); with accumulation the check runs at the boundary
micro-batch and still finds an early NaN; `zero_grad` skips a refused batch."""

import sys
from pathlib import Path

import pytest
import torch

import infinity
from infinity.engine import StepPhase

sys.path.insert(0, str(Path(__file__).parent))
from test_engine import (  # noqa: E402
    assert_parity,
    config,
    llama,
    llama_batches,
    loss_of,
    mlp,
    mlp_batches,
    train_engine,
    train_reference,
)


def _nan_step(engine, param, x, match):
    """A boundary micro-batch whose gradient of `param` is NaN: its step() raises `match`."""
    handle = param.register_hook(lambda g: g * float("nan"))
    try:
        engine.backward(engine(x).square().mean())
        with pytest.raises(ValueError, match=match):
            engine.step()
    finally:
        handle.remove()


def test_fp16_overflow_skips_the_step_and_lowers_the_scale(tmp_path):
    model = mlp()
    engine = infinity.initialize(model, config(tmp_path, "cpu", "cpu",
                                               fp16={"enabled": True, "initial_scale_power": 8,
                                                     "hysteresis": 1}))
    (x,), _ = mlp_batches(1)[0]
    before = {n: v.clone() for n, v in engine.named_parameters()}
    loss = engine(x.half()).float().square().mean()
    engine.backward(loss * float("inf"))
    engine.step()
    assert engine.skipped_steps == 1 and engine.stats()["loss_scale"] == 2.0**7
    assert all(torch.equal(before[n], v) for n, v in engine.named_parameters())
    loss = engine(x.half()).float().square().mean()
    engine.backward(loss)
    engine.step()
    assert engine.skipped_steps == 1 and engine.global_steps == 2
    assert any(not torch.equal(before[n], v) for n, v in engine.named_parameters())
    engine.close()


def test_the_lr_schedule_does_not_advance_on_a_skipped_fp16_step(tmp_path):
    """As DeepSpeed: the schedule moves on applied steps only, so the step after an overflow
    gets the lr the skipped one would have had."""
    schedule = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                               "warmup_num_steps": 4, "warmup_type": "linear"}}
    engine = infinity.initialize(mlp(), config(tmp_path, "cpu", "cpu", scheduler=schedule, fp16={
        "enabled": True, "initial_scale_power": 8, "hysteresis": 1}))
    (x,), _ = mlp_batches(1)[0]
    lrs = [engine.get_lr()[0]]
    for overflow in (False, True, False, False):
        loss = engine(x.half()).float().square().mean()
        engine.backward(loss * float("inf") if overflow else loss)
        engine.step()
        lrs.append(engine.get_lr()[0])
    assert engine.skipped_steps == 1 and engine.global_steps == 4
    engine.close()
    # lr after k applied steps: 0.01 * min(1, (k - 1) / 4); the second step applied nothing
    assert lrs == pytest.approx([0.0, 0.0, 0.0, 0.0025, 0.005], rel=1e-12, abs=0)


@pytest.mark.parametrize("clipping", [0.0, 1.0])
@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_non_finite_gradient_fails_the_step_and_updates_nothing(tmp_path, offload, clipping):
    """fp32 (no loss scale to lower), a NaN in one unit's gradient only: the step raises naming
    the unit and no parameter (nor the step count) changes, whichever unit holds it: here the
    last one stepped, after backward, or the last one final in backward when the optimizer
    overlaps it (the units stepped speculatively before it are rolled back)."""
    model = mlp()
    engine = infinity.initialize(model, config(tmp_path, offload, offload,
                                               gradient_clipping=clipping))
    # "auto" overlaps where anything is on NVMe, or on an accelerator
    assert engine.overlap == (offload == "nvme" or engine.device.type != "cpu")
    bad = model[0] if engine.overlap else model[4]
    (x,), _ = mlp_batches(1)[0]
    before = {n: v.clone() for n, v in engine.named_parameters()}
    unit = "param/0" if engine.overlap else "param/4"
    _nan_step(engine, bad.weight, x, rf"non-finite gradient values \(inf/nan\) in {unit}: the "
              r"step was not taken, no parameter changed")
    assert all(torch.equal(before[n], v) for n, v in engine.named_parameters())
    assert engine.global_steps == 0 and engine.phase is StepPhase.IDLE
    engine.close()


def test_a_nan_in_a_gradient_kept_on_nvme_is_refused_and_training_goes_on(tmp_path):
    """Gradients on NVMe (a host budget too small for them) are checked as they become final,
    where the worker steps them speculatively: step() refuses the step, nothing changed, and
    after zero_grad() training goes on."""
    model = llama()
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme",
                                               infinity={"host_memory_budget": 240_000}))
    assert engine.overlap and engine.plan.grads_tier is not None
    before = {n: v.clone() for n, v in engine.named_parameters()}
    handle = model.get_input_embeddings().weight.register_hook(lambda g: g * float("nan"))
    (args, kwargs), = llama_batches(1)
    engine.backward(loss_of(engine(*args, **kwargs)))
    handle.remove()
    with pytest.raises(infinity.NonFiniteGradientError, match="embed_tokens: the step was not"):
        engine.step()
    assert engine.phase is StepPhase.IDLE and engine.global_steps == 0
    assert all(torch.equal(before[n], v) for n, v in engine.named_parameters())
    engine.zero_grad()
    train_engine(engine, llama_batches(1))
    assert engine.global_steps == 1
    engine.close()


class _Branchy(torch.nn.Module):
    """`b` and `shift` take part only while `use_b`: a unit, and a piece of the root's unit, that
    a later micro-batch of an accumulation leaves untouched."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
        self.scale, self.shift = (torch.nn.Parameter(torch.ones(4)),
                                  torch.nn.Parameter(torch.zeros(4)))
        self.use_b = True

    def forward(self, x):
        y = self.a(x) * self.scale
        return y + self.b(x) + self.shift if self.use_b else y


@pytest.mark.parametrize("where", ["a.weight", "b.weight", "shift"])
def test_a_nan_in_an_early_micro_batch_fails_the_accumulated_step(tmp_path, where):
    """Gradients are checked for inf/nan at the boundary micro-batch only (inf/nan survive the
    in-place sums), so a NaN from the first micro-batch must still be found there: in a piece the
    boundary micro-batch adds to (a.weight), in a unit it never reaches (b), and in a piece of a
    unit it reaches that it leaves alone (shift)."""
    model = _Branchy()
    engine = infinity.initialize(model, config(tmp_path, gradient_accumulation_steps=2))
    (x,), _ = mlp_batches(1)[0]
    for _ in range(2):  # one clean step first: the gradient buffers exist, as in a long run
        engine.backward(engine(x).square().mean())
        engine.step()
    assert engine.global_steps == 1
    before = {n: v.clone() for n, v in engine.named_parameters()}
    handle = model.get_parameter(where).register_hook(lambda g: g * float("nan"))
    engine.backward(engine(x).square().mean())
    engine.step()  # not a boundary
    handle.remove()
    model.use_b = False
    engine.backward(engine(x).square().mean())
    with pytest.raises(ValueError, match="the step was not taken"):
        engine.step()
    assert all(torch.equal(before[n], v) for n, v in engine.named_parameters())
    engine.close()


@pytest.mark.parametrize("gas", [1, 2])
def test_zero_grad_after_a_refused_step_skips_the_batch(tmp_path, gas):
    """A step refused for a NaN changed nothing but ended its accumulation; zero_grad drops
    the NaN gradients and training goes on as if that accumulation's micro-batches had never
    been seen (with gas 2 the next micro-batch starts a new accumulation, not ends one)."""
    model = mlp()
    engine = infinity.initialize(model, config(tmp_path, gradient_accumulation_steps=gas))
    data = mlp_batches(4 * gas)
    train_engine(engine, data[:gas])
    refused = data[gas:2 * gas]
    train_engine(engine, refused[:-1])
    (x,), _ = refused[-1]
    _nan_step(engine, model[4].weight, x, "the step was not taken")
    engine.zero_grad()
    assert (engine.global_steps, engine.micro_steps) == (1, 2 * gas)
    losses = train_engine(engine, data[2 * gas:])
    assert engine.global_steps == 3
    engine.close()
    reference = mlp()
    ref_losses = train_reference(reference, data[:gas] + data[2 * gas:], gas=gas)
    assert_parity(model, reference, losses, ref_losses[gas:])


@pytest.mark.parametrize("offload", ["none", "nvme"])
def test_a_non_finite_gradient_is_a_non_finite_gradient_error(tmp_path, offload):
    """Refused after backward or overlapped (nothing changed either way): a
    NonFiniteGradientError, a ValueError as before."""
    model = mlp()
    engine = infinity.initialize(model, config(tmp_path, offload, offload))
    assert engine.overlap is (offload == "nvme")
    (x,), _ = mlp_batches(1)[0]
    handle = model[0].weight.register_hook(lambda g: g * float("nan"))
    engine.backward(engine(x).square().mean())
    with pytest.raises(infinity.NonFiniteGradientError) as error:
        engine.step()
    handle.remove()
    assert isinstance(error.value, ValueError)
    assert infinity.errors.NonFiniteGradientError is infinity.NonFiniteGradientError
    assert engine.phase is StepPhase.IDLE
    engine.close()


def test_a_tail_unit_that_fails_again_leaves_the_step_to_be_tried_again(tmp_path):
    """A unit of the tail whose step fails again (here a learning rate the kernel refuses)
    raises its own error: the step stays unfinished, to be tried again, and no checkpoint load
    is asked for."""
    engine = infinity.initialize(mlp(), config(tmp_path, "nvme", "nvme"))
    engine.optimizer.lr = -1.0  # taken by the next boundary backward as its step's lr
    (x,), _ = mlp_batches(1)[0]
    engine.backward(engine(x).square().mean())
    engine.step()  # one process: returns with the tail still to settle
    with pytest.raises(ValueError, match="Invalid learning rate") as error:
        engine(x)  # waits for unit 0 of the tail, steps it again, which fails again
    assert not isinstance(error.value, infinity.NonFiniteGradientError)
    assert engine.phase is StepPhase.TAIL_OPEN
    with pytest.raises(ValueError, match="Invalid learning rate"):
        engine.step()  # settles the tail: the same error, the step left unfinished
    assert engine.phase is StepPhase.IDLE
    engine.close()
