"""The engine's step as a state machine: its phases and the moves between them, the step
counters a checkpoint keeps, and the global gradient norm, which the overlapped step reports as
the step after backward does, to the bit (issue 19)."""

import sys
import textwrap
from pathlib import Path

import pytest
import torch
from children import python_child

import infinity
from infinity.engine import StepCounters, StepPhase
from infinity.engine._step_state import check_move

sys.path.insert(0, str(Path(__file__).parent))
from test_engine import (  # noqa: E402
    LR,
    WD,
    config,
    llama,
    llama_batches,
    loss_of,
    mlp,
    mlp_batches,
)


def test_the_step_moves_through_its_phases_and_refuses_illegal_moves(tmp_path):
    engine = infinity.initialize(mlp(), config(tmp_path, "nvme", "nvme",
                                               gradient_accumulation_steps=2))
    assert engine.overlap and engine.phase is StepPhase.IDLE
    (x,), _ = mlp_batches(1)[0]
    engine.backward(engine(x).square().mean())
    assert engine.phase is StepPhase.IDLE  # not a boundary: gradients accumulate
    engine.step()
    engine.backward(engine(x).square().mean())
    assert engine.phase is StepPhase.STEPPING  # units go to the worker as their gradients are final
    with pytest.raises(RuntimeError, match="backward\\(\\) twice in one accumulation boundary"):
        engine.backward(engine(x).square().mean())
    with pytest.raises(RuntimeError, match="zero_grad\\(\\) between a boundary backward"):
        engine.zero_grad()
    engine.step()
    assert engine.phase is StepPhase.TAIL_OPEN  # one process: the tail runs into the next forward
    engine.synchronize()
    assert engine.phase is StepPhase.IDLE and engine.counters == StepCounters(1, 2, 0, 0)
    engine.close()
    assert engine.phase is StepPhase.CLOSED
    for call in (engine.step, lambda: engine(x), engine.zero_grad):
        with pytest.raises(infinity.ClosedError, match="the engine is closed") as error:
            call()
        assert isinstance(error.value, RuntimeError) and isinstance(error.value, ValueError)
    engine.close()  # closing twice is harmless
    with pytest.raises(RuntimeError, match="cannot go from 'idle' to 'tail open'"):
        check_move(StepPhase.IDLE, StepPhase.TAIL_OPEN)
    with pytest.raises(RuntimeError, match="cannot go from 'closed' to 'idle'"):
        check_move(StepPhase.CLOSED, StepPhase.IDLE)


def test_a_forked_child_refuses_its_parents_engine_and_exits(tmp_path):
    """os.fork() copies an engine but none of its threads (the optimizer's worker, the
    readers): using it in the child waited forever for them. Now every call there is refused
    with ClosedError naming the owner, close() there does nothing, the child exits, and the
    parent trains on."""
    code = textwrap.dedent(f"""
        import faulthandler, os, sys, torch, infinity
        nvme = {{"device": "nvme", "nvme_path": {str(tmp_path)!r}}}
        linear = torch.nn.Linear
        model = torch.nn.Sequential(linear(16, 16), torch.nn.ReLU(), linear(16, 1))
        engine = infinity.initialize(model, {{
            "train_micro_batch_size_per_gpu": 1,
            "optimizer": {{"type": "AdamW", "params": {{"lr": 1e-3}}}},
            "zero_optimization": {{"stage": 3, "offload_param": nvme, "offload_optimizer": nvme}}}})
        def train():
            engine.backward(engine(torch.ones(4, 16)).square().mean())
            engine.step()
        train()
        pid = os.fork()
        if pid == 0:
            faulthandler.dump_traceback_later(30, exit=True)  # a hung child ends itself
            try:
                train()
            except infinity.ClosedError as e:
                print("child:", e, flush=True)
            engine.close()
            sys.exit(0)
        print("child exit", os.waitpid(pid, 0)[1], flush=True)
        train()
        print("parent steps", engine.global_steps, flush=True)
        engine.close()
    """)
    out = python_child(["-c", code], timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "child: this engine belongs to process" in out.stdout, out.stdout
    assert "child exit 0" in out.stdout and "parent steps 2" in out.stdout


def test_a_checkpoint_restores_the_step_counters(tmp_path):
    schedule = {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}
    model, data = mlp(), mlp_batches(3)
    cfg = config(tmp_path, gradient_accumulation_steps=2, scheduler=schedule)
    engine = infinity.initialize(model, cfg)
    for (x,), _ in data:
        engine.backward(engine(x).square().mean())
        engine.step()
    engine.save_checkpoint(tmp_path / "ckpt")
    saved = engine.counters
    engine.close()
    assert saved == StepCounters(global_steps=1, micro_steps=3, skipped_steps=0, schedule_steps=1)
    with infinity.initialize(mlp(), cfg) as resumed:
        resumed.load_checkpoint(tmp_path / "ckpt")
        assert resumed.counters == saved and resumed.get_lr() == engine.get_lr()


def _norms(engine, batches):
    """last_grad_norm after each boundary step()."""
    norms = []
    for args, kwargs in batches:
        engine.backward(loss_of(engine(*args, **kwargs)))
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            norms.append(engine.last_grad_norm)
    return norms


@pytest.mark.parametrize("gas", [1, 2])
@pytest.mark.parametrize("make, batches", [(mlp, mlp_batches), (llama, llama_batches)])
def test_the_overlapped_step_reports_the_norm_of_the_step_after_backward(tmp_path, make, batches,
                                                                          gas):
    """Overlapped (speculated too, with clipping), each unit's sum of squares is taken as its
    gradient becomes final; stepped after backward with clipping (here never acting), the norm
    comes first. All report the same norm, to the bit, and torch's within 1e-5; stepped after
    backward without clipping or fp16 the norm is not taken (a pass over every gradient)."""
    data = batches(4)
    after = {"host_memory_budget": "1GB", "overlap_optimizer": False}
    runs = {"overlapped": {}, "speculated": {"gradient_clipping": 1e3},
            "clipping": {"gradient_clipping": 1e3, "infinity": after}, "plain": {"infinity": after}}
    norms = {}
    for name, extra in runs.items():
        cfg = config(tmp_path, "nvme", "nvme", gradient_accumulation_steps=gas, **extra)
        engine = infinity.initialize(make(), cfg)
        assert engine.overlap is (name in ("overlapped", "speculated"))
        norms[name] = _norms(engine, data)
        engine.close()
    assert len(norms["overlapped"]) == 4 // gas and all(n > 0 for n in norms["overlapped"])
    assert norms["overlapped"] == norms["speculated"] == norms["clipping"]
    assert norms["plain"] == [None] * (4 // gas)
    model = make()  # plain PyTorch: the norm of the accumulated gradients before each update
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    reference = []
    for i, (args, kwargs) in enumerate(data):
        (loss_of(model(*args, **kwargs)) / gas).backward()
        if (i + 1) % gas == 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))  # no clipping
            reference.append(float(norm))
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(norms["overlapped"], reference, rtol=1e-5, atol=0)
