"""The engine's step as a state machine: its phases and the moves between them, and the step
counters a checkpoint keeps."""

import sys
from pathlib import Path

import pytest

import infinity
from infinity.engine import StepCounters, StepPhase
from infinity.engine._step_state import check_move

sys.path.insert(0, str(Path(__file__).parent))
from test_engine import config, mlp, mlp_batches  # noqa: E402


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

