"""The speculative overlapped step (issue 22; [Note: speculate, then validate] in
infinity/engine/_overlap.py): the units are stepped during backward, then committed or rolled
back once the norm and finiteness are known, with clipping or fp16 or neither. Overlapped, the
engine equals the stepped-after-backward engine bit for bit (clipping that acts and that does
not, a NaN, an fp16 overflow, accumulation, state on NVMe and in RAM), and plain PyTorch within
1e-5; a refused step changes nothing; a rollback that fails breaks the engine until a
checkpoint load."""

import concurrent.futures
import dataclasses
import errno
import logging
import sys
from pathlib import Path

import pytest
import torch

import aio
import infinity
from infinity.engine import StepPhase
from infinity.engine._overlap import UnitStepper

sys.path.insert(0, str(Path(__file__).parent))
from test_engine import (  # noqa: E402
    assert_parity,
    config,
    loss_of,
    mlp,
    mlp_batches,
    train_reference,
)

OFFLOADS = [("nvme", "nvme"), ("cpu", "cpu")]
FP16 = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}


@pytest.fixture
def patient_worker(monkeypatch):
    """Validation takes no unit out of the worker's queue: every unit handed over in backward
    is stepped speculatively, however far behind the worker is (deterministic counts)."""
    monkeypatch.setattr(UnitStepper, "withdraw", lambda self: None)


def _engine(tmp_path, offload, overlap, **extra):
    extra.setdefault("infinity", {})
    extra["infinity"] = {"host_memory_budget": "1GB", **extra["infinity"],
                         "overlap_optimizer": overlap}
    path = tmp_path / ("overlapped" if overlap else "after")
    path.mkdir(exist_ok=True)
    engine = infinity.initialize(mlp(), config(path, *offload, **extra))
    assert engine.overlap is overlap
    return engine


def _state(engine):
    """What a step changes: the values, the optimizer's state (moments, step), the counters,
    the learning rate."""
    values = dict(engine.named_parameters())
    moments = [(u, {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()})
               for u, state in engine.optimizer.iter_state()]
    return values, moments, dataclasses.replace(engine.counters), engine.get_lr()


def _assert_same_state(a, b):
    (values_a, moments_a, *rest_a), (values_b, moments_b, *rest_b) = a, b
    assert rest_a == rest_b
    assert all(torch.equal(values_a[n], values_b[n]) for n in values_a)
    for (u, state_a), (_, state_b) in zip(moments_a, moments_b, strict=True):
        for k in state_a:
            same = torch.equal if torch.is_tensor(state_a[k]) else (lambda x, y: x == y)
            assert same(state_a[k], state_b[k]), (u, k)


def _train(engine, batches, *, nan_at=(), half=False):
    """Train on `batches`; the boundary micro-batches at `nan_at` get a NaN in the middle
    Linear's weight gradient, their step is refused (checked: nothing changed, values, moments,
    counters, learning rate) and dropped with zero_grad(). Returns (losses, parameters)."""
    losses = []
    for k, ((x,), _) in enumerate(batches):
        handle = before = None
        if k in nan_at:
            before = _state(engine)
            handle = engine.module[2].weight.register_hook(lambda g: g * float("nan"))
        loss = loss_of(engine(x.half() if half else x).float())
        engine.backward(loss)
        losses.append(loss.item())
        if k not in nan_at:
            engine.step()
            continue
        assert engine.is_gradient_accumulation_boundary()
        handle.remove()
        with pytest.raises(infinity.NonFiniteGradientError, match="non-finite gradient values"):
            engine.step()
        assert engine.phase is StepPhase.IDLE
        engine.zero_grad()
        before[2].micro_steps += 1  # (the refused step() ends its accumulation all the same)
        _assert_same_state(_state(engine), before)
    return losses, dict(engine.named_parameters())


def _identical(a, b):
    (losses_a, values_a), (losses_b, values_b) = a, b
    assert losses_a == losses_b
    assert values_a.keys() == values_b.keys()
    for name in values_a:
        assert torch.equal(values_a[name], values_b[name]), name


@pytest.mark.parametrize("offload", OFFLOADS)
@pytest.mark.parametrize("clip", [0.05, 1e3])
@pytest.mark.parametrize("gas", [1, 2])
def test_speculated_steps_equal_the_step_after_backward(tmp_path, patient_worker, offload, clip,
                                                        gas):
    batches = mlp_batches(4 * gas)
    runs, stats = {}, None
    for overlap in (False, True):
        engine = _engine(tmp_path, offload, overlap, gradient_clipping=clip,
                         gradient_accumulation_steps=gas, infinity={"speculate": "always"})
        runs[overlap] = _train(engine, batches)
        stats = engine.stats()["optimizer"]
        engine.close()
    _identical(runs[True], runs[False])
    assert stats["units_speculated"] == stats["units_stepped_in_backward"] == 4 * 3
    if clip == 0.05:  # the norm is always above it: every step rolled back and redone
        assert stats["rollbacks"] == 4 and stats["units_rolled_back"] == 4 * 3
    else:
        assert stats["rollbacks"] == stats["units_rolled_back"] == 0
    reference = mlp()
    ref_losses = train_reference(reference, batches, gas=gas, clip=clip)
    model = mlp()
    model.load_state_dict(runs[True][1])
    assert_parity(model, reference, runs[True][0], ref_losses)


@pytest.mark.parametrize("offload", OFFLOADS)
def test_a_step_after_one_where_clipping_acted_is_not_speculated(tmp_path, patient_worker,
                                                                 offload):
    """speculate "auto": clipping acts at step 1 (its loss scaled up), so step 2 is stepped
    once validated, not during backward; clipping does not act there, so step 3 speculates
    again. Bit for bit the stepped-after-backward engine all along."""
    batches = mlp_batches(4)
    big = {1}
    runs = {}
    for overlap in (False, True):
        with _engine(tmp_path, offload, overlap, gradient_clipping=1e3) as engine:
            losses = []
            for k, ((x,), _) in enumerate(batches):
                loss = loss_of(engine(x)) * (1e6 if k in big else 1.0)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            runs[overlap] = losses, dict(engine.named_parameters())
            stats = engine.stats()["optimizer"]
    _identical(runs[True], runs[False])
    assert stats["steps_not_speculated"] == 1 and stats["rollbacks"] == 1
    assert stats["units_speculated"] == stats["units_stepped_in_backward"] == 3 * 3
    assert stats["units_rolled_back"] == 3


def test_a_worker_behind_backward_speculates_what_it_started(tmp_path):
    """Without holding the worker: units not started when backward ends are taken out of its
    queue and stepped once the step is validated; the result is the same."""
    batches = mlp_batches(4)
    runs = {}
    for overlap in (False, True):
        with _engine(tmp_path, ("nvme", "nvme"), overlap, gradient_clipping=0.05) as engine:
            runs[overlap] = _train(engine, batches)
            stats = engine.stats()["optimizer"]
    _identical(runs[True], runs[False])
    assert stats["units_rolled_back"] == stats["units_speculated"] <= 4 * 3


@pytest.mark.parametrize(("offload", "gas", "clip"), [
    *[(offload, gas, 0.0) for offload in OFFLOADS for gas in (1, 2)],  # the plain overlap
    (OFFLOADS[0], 2, 1e3), (OFFLOADS[1], 1, 1e3)],  # clipping that does not act
    ids=lambda v: v[0] if isinstance(v, tuple) else str(v))
def test_a_nan_in_one_unit_rolls_the_step_back_and_training_goes_on(tmp_path, patient_worker,
                                                                     offload, gas, clip):
    batches = mlp_batches(4 * gas)
    nan_at = {2 * gas - 1}  # the second step's boundary micro-batch
    runs = {}
    for overlap in (False, True):
        with _engine(tmp_path, offload, overlap, gradient_clipping=clip,
                     gradient_accumulation_steps=gas) as engine:
            runs[overlap] = _train(engine, batches, nan_at=nan_at)
            stats, counters = engine.stats()["optimizer"], engine.counters
    _identical(runs[True], runs[False])
    # the first and last Linear were speculated (the middle one's step failed on the NaN)
    assert counters.global_steps == 3 and stats["rollbacks"] == 1
    assert stats["units_rolled_back"] == 2


@pytest.mark.parametrize("offload", OFFLOADS)
def test_an_fp16_overflow_rolls_the_step_back_and_skips_it(tmp_path, patient_worker, offload):
    batches = mlp_batches(4)
    runs = {}
    for overlap in (False, True):
        with _engine(tmp_path, offload, overlap, fp16=FP16, gradient_clipping=0.05,
                     infinity={"speculate": "always"}) as engine:
            losses, scales = [], []
            for k, ((x,), _) in enumerate(batches):
                handle = None
                if k == 1:  # an overflow in the middle Linear's weight gradient only
                    handle = engine.module[2].weight.register_hook(lambda g: g * float("inf"))
                loss = loss_of(engine(x.half()).float())
                engine.backward(loss)
                engine.step()
                if handle is not None:
                    handle.remove()
                losses.append(loss.item())
                scales.append(engine.stats()["loss_scale"])
            runs[overlap] = losses, dict(engine.named_parameters())
            stats, counters = engine.stats()["optimizer"], engine.counters
    _identical(runs[True], runs[False])
    assert counters.skipped_steps == 1 and counters.global_steps == 4
    assert scales == [2.0**8, 2.0**7, 2.0**7, 2.0**7]
    # every step rolled back: three where clipping acts, one overflow (two units speculated)
    assert stats["rollbacks"] == 4 and stats["units_speculated"] == 3 * 3 + 2


@pytest.mark.parametrize(("no_room_for", "speculated"), [(1, [2, 0]), (2, [])])
def test_a_unit_with_no_room_to_speculate_is_stepped_after_validation(
        tmp_path, patient_worker, caplog, no_room_for, speculated):
    """The optimizer finds no room to keep a unit's old state (keep_unit returns False, before
    its gradient is read): that unit, and those at least as large whose gradients are final
    after it, wait for validation; the others are speculated; the result is the same. The MLP's
    units hold 288, 1056 and 132 elements; backward finishes unit 2 first, then 1, then 0."""
    batches = mlp_batches(3)
    runs = {}
    for overlap in (False, True):
        with _engine(tmp_path, ("cpu", "cpu"), overlap, gradient_clipping=1e3) as engine:
            assert [u.numel for u in engine.units] == [288, 1056, 132]
            tried = []

            def no_room(u, keep_unit=engine.optimizer.keep_unit, tried=tried):
                tried.append(u)
                return u != no_room_for and keep_unit(u)

            engine.optimizer.keep_unit = no_room
            with caplog.at_level(logging.WARNING, logger="infinity.engine._overlap"):
                runs[overlap] = _train(engine, batches)
            stats = engine.stats()["optimizer"]
    _identical(runs[True], runs[False])
    # in backward's order; no other unit even asked for room
    assert tried == [u for u in (2, 1, 0) if u == no_room_for or u in speculated] * 3
    assert stats["units_speculated"] == 3 * len(speculated) and stats["rollbacks"] == 0
    assert "no room in the store to keep the state a speculative step" in caplog.text


def test_overlap_optimizer_true_with_clipping_and_fp16_overlaps(tmp_path):
    for extra in ({"gradient_clipping": 1.0}, {"fp16": FP16}):
        with _engine(tmp_path, ("none", "none"), True, **extra) as engine:
            assert engine.overlap


def test_a_checkpoint_is_refused_while_units_are_speculated(tmp_path):
    """Between a boundary backward and its step() the units hold a speculated state: a save
    there is refused; after step() it holds the committed step."""
    with _engine(tmp_path, ("nvme", "nvme"), True, gradient_clipping=0.05) as engine:
        (x,), _ = mlp_batches(1)[0]
        engine.backward(loss_of(engine(x)))
        with pytest.raises(RuntimeError, match="save_checkpoint\\(\\) between a boundary"):
            engine.save_checkpoint(tmp_path / "ckpt")
        engine.step()
        engine.save_checkpoint(tmp_path / "ckpt")
        saved = dict(engine.named_parameters())
    with _engine(tmp_path, ("nvme", "nvme"), False, gradient_clipping=0.05) as resumed:
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert all(torch.equal(v, saved[n]) for n, v in resumed.named_parameters())


def test_a_rollback_that_fails_breaks_the_engine_until_a_checkpoint_load(tmp_path,
                                                                         patient_worker):
    """An I/O error in the store's rollback (patched in, on the rollback and its retry: on
    NVMe a rollback does no I/O) while a NaN step is undone: the engine is BROKEN, the error names
    the cause in one line, backward and step refuse to go on, and a checkpoint load recovers:
    training goes on bit for bit as if the NaN batch had never been seen."""
    batches = mlp_batches(4)
    with _engine(tmp_path, ("nvme", "nvme"), False) as engine:
        expected = _train(engine, batches[:1] + batches[2:])
    with _engine(tmp_path, ("nvme", "nvme"), True) as engine:
        losses = _train(engine, batches[:1])[0]
        engine.save_checkpoint(tmp_path / "ckpt", tag="good")
        (x,), _ = batches[1]
        handle = engine.module[2].weight.register_hook(lambda g: g * float("nan"))
        engine.backward(loss_of(engine(x)))
        handle.remove()
        futures = [engine._stepper.future(i) for i in range(len(engine.ranked.trained))]
        concurrent.futures.wait([f for f in futures if f is not None])  # the worker is done
        rollback, failures = engine.store.rollback, [0]

        def failing_twice(key):
            failures[0] += 1
            if failures[0] <= 2:
                raise aio.AIOError(errno.EIO, "injected", "swap", op="read")
            rollback(key)

        engine.store.rollback = failing_twice
        with pytest.raises(RuntimeError) as error:
            engine.step()
        assert failures[0] == 2
        message = str(error.value)
        assert "\n" not in message and isinstance(error.value.__cause__, aio.AIOError)
        assert message.startswith("the step could not be undone (AIOError: ") and "EIO" in message
        assert message.endswith("the engine is broken, load a checkpoint "
                                "(engine.load_checkpoint) to go on")
        assert engine.phase is StepPhase.BROKEN
        for call in (lambda: engine.backward(torch.ones((), requires_grad=True) * 2),
                     engine.step):
            with pytest.raises(RuntimeError, match="^the engine is broken: .* load a checkpoint"):
                call()
        engine.load_checkpoint(tmp_path / "ckpt", tag="good")
        assert engine.phase is StepPhase.IDLE
        more, values = _train(engine, batches[2:])
    _identical((losses + more, values), expected)


def test_fit_nvme_budget_gives_up_only_the_kept_room():
    from infinity.engine._plan import fit_nvme_budget
    assert fit_nvme_budget(1000, 300, free=6400) == 1000  # fits: unchanged
    assert fit_nvme_budget(1000, 300, free=960) == 945  # the disk less 1/64, above the rest
    assert fit_nvme_budget(1000, 300, free=640) == 1000  # not even the rest: opening fails
    # room kept free for what the run writes beside the swap file: only the kept room gives way
    assert fit_nvme_budget(1000, 300, free=6400, keep_free=5000) == 1000
    assert fit_nvme_budget(1000, 300, free=6400, keep_free=5400) == 900
    assert fit_nvme_budget(1000, 300, free=6400, keep_free=6000) == 700
    assert fit_nvme_budget(1000, 300, free=640, keep_free=100) == 1000


def test_a_disk_without_room_for_the_kept_state_still_trains_the_same(tmp_path, patient_worker,
                                                                     monkeypatch, caplog):
    """nvme_path's disk cannot hold the swap file with a speculated step's kept copy: the
    engine opens a smaller one (saying so) and trains as the stepped-after-backward engine,
    a refused NaN step included."""
    from infinity.engine import _placement
    seen = {}

    def small_disk(budget, kept, free, keep_free):
        seen.update(budget=budget, kept=kept, keep_free=keep_free)
        return fit(budget, kept, free=budget - kept // 2 + (budget - kept // 2) // 63 + 64)

    fit = _placement.fit_nvme_budget
    monkeypatch.setattr(_placement, "fit_nvme_budget", small_disk)
    batches = mlp_batches(4)
    runs = {}
    for overlap in (False, True):
        with caplog.at_level(logging.WARNING, logger="infinity.engine._placement"), \
                _engine(tmp_path, ("nvme", "nvme"), overlap, gradient_clipping=1e3) as engine:
            runs[overlap] = _train(engine, batches, nan_at={1})
            nvme_budget = engine.store.budgets[infinity.store.Tier.NVME]
    _identical(runs[True], runs[False])
    assert seen["kept"] > 0 and seen["budget"] - seen["kept"] < nvme_budget < seen["budget"]
    assert seen["keep_free"] == 0
    assert "units without room are stepped after validation" in caplog.text
