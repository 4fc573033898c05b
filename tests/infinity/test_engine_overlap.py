"""The optimizer overlapped with backward (no clipping, no fp16): units stepped on the worker as
their gradients become final, the state read ahead, the step's tail running into the next
forward, a unit that failed on the worker stepped again; every case equal to plain PyTorch
(and bit for bit to the step after backward). Speculation under clipping or fp16:
test_engine_speculative.py."""

import copy
import json
import math
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import infinity
from infinity.engine import StepPhase

sys.path.insert(0, str(Path(__file__).parent))
from test_engine import (  # noqa: E402
    LR,
    WD,
    assert_identical,
    assert_parity,
    config,
    loss_of,
    mlp,
    mlp_batches,
    stepped_after_backward,
    train_engine,
    train_reference,
)


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
    opt, asked, read = engine.optimizer, [], []
    prefetch_unit, stepper = opt.prefetch_unit, engine._stepper._stepper
    read_ahead = stepper._read_ahead

    def spy_read_ahead(u):  # asked on the worker or the thread that queues units
        asked.append((u, opt.completed_steps))
        read_ahead(u)

    def spy_prefetch_unit(u):  # done on the engine's read-ahead thread
        read.append(u)
        return prefetch_unit(u)

    stepper._read_ahead, opt.prefetch_unit = spy_read_ahead, spy_prefetch_unit
    _hold_the_worker(engine)  # slower than backward: it steps the first unit once backward ended
    losses = train_engine(engine, data)
    assert engine.units_stepped_in_backward == 6
    engine._reader.submit(lambda: None).result()  # what was asked has run (or was let go)
    assert len(read) >= 2, read  # the step it was asked for may be done before it runs
    engine.close()
    assert_parity(model, reference, losses, train_reference(reference, data))
    # Backward makes units 2, 1, 0 final in that order and the worker runs one while the others
    # wait behind it: in each step, two of them were read ahead while another was stepped
    # (which two depends on when the held worker starts relative to the tail's reordering).
    for step in (0, 1):
        assert len({u for u, done in asked if done == step}) >= 2, asked


def test_a_unit_backward_let_go_is_kept_in_ram_for_its_step_and_its_gradient_freed_after(tmp_path):
    """Released after its backward, a unit's values are next read by the optimizer worker, not
    by the next forward (the trace's next use): the store is told they are needed soon (issue 7:
    the worker read them from NVMe again, 0.7 of 8.35 GB/step on the 294M GPT), and once stepped
    during backward, where the next forward first uses them: the first layer soonest (told
    "last", a tier holding every value evicted them first and read them all again each step).
    Its gradient is let go as soon as it is stepped, not at the end of the step (peak RSS 2.80
    -> 2.23 GB there)."""
    model, reference, data = mlp(), mlp(), mlp_batches(3)
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme"))
    log = []
    set_next_use, step_unit = engine.store.set_next_use, engine.optimizer.step_unit

    def spy_hints(hints):
        set_next_use(hints)  # and the store's clock reading of it: when, not how far
        entries = engine.store._copies.entries
        log.extend(("hint", k, (d, entries[k].next_use)) for k, d in hints.items())

    def spy_step(u, grad, **kw):
        key = engine.optimizer.units[u].values_key
        log.append(("step", key, len(losses)))  # the training step it belongs to
        return step_unit(u, grad, **kw)

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
        last_hint = next(v[0] for kind, k, v in reversed(log[:n]) if kind == "hint" and k == key)
        assert last_hint < 100, (key, last_hint)  # needed soon (the trace says: next forward)
    # the next use each unit stepped in backward was given, on the store's clock, by step
    after = {}
    for n in steps:
        hint = next((v[1] for kind, k, v in log[n + 1:] if kind == "hint" and k == log[n][1]),
                    None)
        if hint is not None:
            after.setdefault(log[n][2], {})[log[n][1]] = hint
    keys = [u.key for u in engine.ranked.trained]  # forward order
    ordered = [[by_key[k] for k in keys if k in by_key] for by_key in after.values()]
    assert any(len(hints) == len(keys) and math.inf not in hints for hints in ordered), after
    for hints in ordered:  # (the first step has no trace yet: last)
        assert hints == sorted(hints), after


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


def _hold_the_worker(engine, fail=(), *, tail_started=False):
    """The optimizer worker is slower than backward, deterministically: it starts no unit
    while backward runs, so step() withdraws every unit backward handed over (none is running)
    and returns with all of them still to step, the first one held in its step until the next
    forward begins (or something waits for the step: synchronize). The units in `fail` raise
    OSError on their first step. `tail_started`: step() returns once the worker holds the
    tail's first unit (its optimizer region open before the next forward starts)."""
    step_unit, failing = engine.optimizer.step_unit, set(fail)
    go = threading.Event()  # the tail may step
    started = threading.Event()  # the worker may start a unit: backward is over
    holding = threading.Event()  # the worker holds the tail's first unit, in its step
    synchronize, overlapped, step = engine.synchronize, engine._stepper, engine.step
    run_next, end_speculation = overlapped._stepper._run_next, overlapped.end_speculation

    def held_run_next():
        assert started.wait(timeout=60), "step() never came to end the speculation"
        run_next()

    def held_step_unit(u, grad, **kw):
        if not kw.get("speculative"):
            holding.set()
            assert go.wait(timeout=60), "neither a forward nor synchronize released the worker"
        if u in failing:
            failing.discard(u)
            raise OSError(f"injected failure stepping unit {u}")
        return step_unit(u, grad, **kw)

    def end_speculation_then_start():
        try:
            return end_speculation()
        finally:
            holding.clear()
            started.set()

    def step_then_wait_for_the_hold():  # step() returns; its tail's first unit is held
        step()
        if engine.phase is StepPhase.TAIL_OPEN:
            assert holding.wait(timeout=60), "the worker never started the step's tail"

    def release():
        go.set()
        started.set()

    def synchronize_then_hold():  # backward calls it first: its step's units are held again
        release()
        synchronize()
        go.clear()
        started.clear()

    engine.optimizer.step_unit = held_step_unit
    engine.synchronize = synchronize_then_hold
    if tail_started:
        engine.step = step_then_wait_for_the_hold
    overlapped._stepper._run_next = held_run_next
    overlapped.end_speculation = end_speculation_then_start
    engine.module.register_forward_pre_hook(lambda module, args: release(), prepend=True)


def test_the_steps_tail_runs_into_the_next_forward(tmp_path):
    """[Note: the step's tail in the next forward]: step() returns with the first layers still
    to step; the next forward waits for each before using it; a WarmupLR schedule moves on at
    step() while the tail still steps with the step's own lr; the result is plain PyTorch's."""
    model, reference, data = mlp(), mlp(), mlp_batches(4)
    schedule = {"type": "WarmupLR", "params": {"warmup_min_lr": LR / 10, "warmup_max_lr": LR,
                                               "warmup_num_steps": 3, "warmup_type": "linear"}}
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme", scheduler=schedule))
    _hold_the_worker(engine, tail_started=True)
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


def test_a_host_tier_that_holds_every_value_reads_none_again(tmp_path):
    """A budget whose rest caches every value but not the optimizer state: the host tier holds
    every value beside a few tiles. Once the trace is known the values stay and the tiles,
    needed a whole step later, come and go (the 294M GPT: 0.57 GB of values read a step ->
    0.04)."""
    def deep():
        torch.manual_seed(0)
        layers = [torch.nn.Linear(8, 32)]
        for _ in range(40):
            layers += [torch.nn.ReLU(), torch.nn.Linear(32, 32)]
        return torch.nn.Sequential(*layers, torch.nn.ReLU(), torch.nn.Linear(32, 4))

    def engine_with(budget):
        return infinity.initialize(deep(), config(tmp_path, "nvme", "nvme",
                                                  infinity={"host_memory_budget": budget}))

    first = engine_with("1GB")
    least = first.plan.min_host_budget  # the smallest plan, and no cache
    cache = sum(-(-u.nbytes // 4096) * 4096 for u in first.ranked.trained)  # every value
    first.close()
    engine = engine_with(least + 2 * cache)  # every value, and room for some of the tiles
    values = sum(u.nbytes for u in engine.ranked.trained)

    def reads(prefix):
        return sum(n for key, src, _, n, _, _ in engine.store.moves._events
                   if key.startswith(prefix) and src.label == "nvme")

    read, tiles_read = [], []
    for args, kwargs in mlp_batches(6):
        before = reads("param/"), reads("optim/")
        engine.backward(loss_of(engine(*args, **kwargs)))
        engine.step()
        read.append(reads("param/") - before[0])
        tiles_read.append(reads("optim/") - before[1])
    assert engine.units_stepped_in_backward > 0
    engine.close()
    assert all(tiles_read[2:])  # the tier cannot hold every tile too: they come and go
    assert read[0] >= values  # the first forward reads every value
    assert sum(read[2:]) / len(read[2:]) < values / 4, (read, values)


@pytest.mark.parametrize("overlap", [True, False], ids=["worker", "after-backward"])
def test_a_read_ahead_that_waits_holds_up_no_step(tmp_path, caplog, overlap):
    """Reading a unit ahead may wait (for room in a full host tier, until the last unit's
    write-backs are out): neither the worker nor the step after backward waits with it, a read
    ahead that fails is only a hint (logged at debug level), and training is unchanged."""
    caplog.set_level("DEBUG", logger="infinity.engine._optimizer_step")
    model, reference, data = mlp(), mlp(), mlp_batches(2)
    engine = infinity.initialize(model, config(tmp_path, "nvme", "nvme", infinity={
        "host_memory_budget": "1GB", "overlap_optimizer": overlap}))
    room, asked = threading.Event(), []

    def prefetch_unit(u):
        asked.append(u)
        if len(asked) == 1:
            room.wait(10)  # the first waits for room ...
        raise OSError("read ahead failed")  # ... then fails, as the others do

    engine.optimizer.prefetch_unit = prefetch_unit
    if overlap:
        _hold_the_worker(engine)  # units queue behind the one it steps: each is read ahead
    try:
        start = time.perf_counter()
        losses = train_engine(engine, data)
        assert time.perf_counter() - start < 5
        assert len(asked) == 1  # the others wait behind it on the reader
    finally:
        room.set()
        engine.close()
    assert_parity(model, reference, losses, train_reference(reference, data))
    assert "read ahead of trained unit" in caplog.text and "read ahead failed" in caplog.text
