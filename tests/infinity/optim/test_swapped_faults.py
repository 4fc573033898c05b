"""A swapped optimizer step that fails part-way is safe to retry: after an injected I/O error at
any read or write of a step, calling it again with the same gradients gives exactly one step's
result (bit for bit against in-memory CPUAdam), and nothing fetched stays in use."""

import pytest
import torch

from infinity.optim.cpu_adam import CPUAdam
from infinity.optim.swapped import SwappedOptimizer, UnitSpec

TILE = 1000
NUMEL = 20_000  # 20 tiles of 8 KB; the unit's values (its master) 80 KB
HOST = (80 << 10) + 4 * (8 << 10) + (16 << 10)  # the values and 4 tiles, and room to spare


def _grad(numel, step, dtype=torch.float32):
    return torch.randn(numel, generator=torch.Generator().manual_seed(100 + step)).to(dtype)


def _one_unit(run, values_of):
    """One float32 unit of 20 tiles (its values entry, the master, on NVMe): two clean steps,
    then the fault from step 3 on; every call is retried."""
    start = torch.randn(NUMEL, generator=torch.Generator().manual_seed(7))
    ref = start.clone()
    run.store.put("unit", start, "nvme")
    opt_ref = CPUAdam([ref], lr=1e-2, weight_decay=0.1)
    opt = SwappedOptimizer([UnitSpec(NUMEL, torch.float32, "unit")], run.store, lr=1e-2,
                           weight_decay=0.1, tile_numel=TILE)
    for step in range(5):
        ref.grad = _grad(NUMEL, step)
        opt_ref.step()
        run.begin(step)
        run.retried(lambda step=step: opt.step_unit(0, _grad(NUMEL, step)), step)
        opt.finish_step()
        run.flushed(opt, step)
        assert opt.completed_steps == step + 1
        ours = run.retried(lambda: values_of(run.store, "unit"), step)
        assert torch.equal(ours, ref), f"step {step}: {(ours != ref).sum()} elements differ"
    (_, state), = run.retried(lambda: list(opt.iter_state()), "state")
    assert state["step"] == 5
    assert torch.equal(state["exp_avg"], opt_ref.state[ref]["exp_avg"])
    assert torch.equal(state["exp_avg_sq"], opt_ref.state[ref]["exp_avg_sq"])
    assert torch.equal(state["master"], ref)
    return run.close()


@pytest.mark.parametrize("op", ["read", "write"])
def test_step_retried_after_a_fault_at_every_position(every_fault_position, values_of, op):
    positions = every_fault_position(lambda run: _one_unit(run, values_of), op, at_step=2,
                                     host_nbytes=HOST)
    # every read / write of step 3 (its step_unit() and flush()) was failed once, and more after
    # it: at least one piece per tile read (a few of 20 stay cached beside the values) or written
    assert positions >= (16 if op == "read" else 20), positions


def _unit_mode(run, put_units, values_of):
    """Units (bf16 and fp32, values on NVMe) stepped in backward's order; the fault from step 2
    on."""
    masters, specs = put_units(run.store, [torch.bfloat16, torch.float32, torch.bfloat16],
                               [5000, 4000, 300])
    opt_ref = CPUAdam(masters, lr=1e-2)
    opt = SwappedOptimizer(specs, run.store, lr=1e-2, tile_numel=TILE)
    for step in range(4):
        grads = [_grad(s.numel, step, s.dtype) for s in specs]
        for m, g in zip(masters, grads):
            m.grad = g.float()
        opt_ref.step()
        run.begin(step)
        for u in reversed(range(len(specs))):
            run.retried(lambda u=u, grads=grads: opt.step_unit(u, grads[u]), step)
        opt.finish_step()
        run.flushed(opt, step)
    states = run.retried(lambda: list(opt.iter_state()), "state")
    for (u, state), master in zip(states, masters):
        assert torch.equal(state["master"], master), u
        assert torch.equal(state["exp_avg_sq"], opt_ref.state[master]["exp_avg_sq"]), u
    for spec, master in zip(specs, masters):
        values = run.retried(lambda key=spec.values_key: values_of(run.store, key), "state")
        assert torch.equal(values, master.to(spec.dtype)), spec
    return run.close()


@pytest.mark.parametrize("op", ["read", "write"])
def test_step_unit_retried_after_a_fault_at_every_position(every_fault_position, put_units,
                                                           values_of, op):
    positions = every_fault_position(lambda run: _unit_mode(run, put_units, values_of), op,
                                     at_step=1, host_nbytes=64 << 10)
    assert positions >= 10, positions  # 10 tiles and 3 values entries go through the disk in a step


@pytest.mark.parametrize("op", ["read", "write"])
def test_load_state_retried_after_a_fault_at_every_position(every_fault_position, op):
    """A load that failed part-way is done again whole; reads of its tiles are released."""
    source = torch.randn(5 * TILE)
    state = {"step": 3, "master": source * 2, "exp_avg": source * 3, "exp_avg_sq": source.abs()}

    def load(run):
        run.store.put("unit", source, "nvme")
        opt = SwappedOptimizer([UnitSpec(source.numel(), torch.float32, "unit")], run.store,
                               tile_numel=TILE)
        run.begin(0)
        run.retried(lambda: opt.load_state([(0, state)]), 0)
        run.flushed(opt, 0)
        (_, loaded), = run.retried(lambda: list(opt.iter_state()), "state")
        assert loaded["step"] == 3 and opt.completed_steps == 3
        for name in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(loaded[name], state[name]), name
        return run.close()

    assert every_fault_position(load, op, at_step=0, host_nbytes=HOST) >= 5
