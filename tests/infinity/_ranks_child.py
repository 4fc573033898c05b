"""One data-parallel rank of tests/infinity/test_engine_ranks.py, started with torchrun's
environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); the engine starts the process group
itself.

    python tests/infinity/_ranks_child.py SPEC.json

SPEC: {"out": dir, "cases": [{"name", "config", "steps", "seed"?, "die_at_step"?}, ...]}. Each
case trains the tiny model of `make_model` on this rank's rows of `global_batch` and records its
micro-batch losses and final parameters into out/rank<r>.pt; a case that raises records the
error's type and message (and the rank carries on with the next case). `die_at_step`: rank 1
exits at once (os._exit) after that step's forward, as a killed rank would; `stall_at_step`:
rank 1 sleeps `stall_s` there instead (a stuck rank), then exits. `zero_init`: build the model
under infinity.zero.Init. `overflow_at_step`: rank 1's gradient of layer 0's bias is multiplied
by inf there. `patient_worker`: the optimizer worker's queue is not cut short when backward
ends, so every unit handed over is stepped speculatively (with clipping or fp16).

Checkpoints: `load` (a directory, or one per rank) restores before training, which then runs
from the loaded step to `steps` (the parameters right after loading are recorded as "loaded");
`save`+`save_after`: save there after that many steps (parameters then recorded as "saved").
Both record "draw", four numbers from torch's RNG right after the save / the load. Every case
records "grad_norms", `engine.last_grad_norm` after each step.
`nan`: {"step", "micro", "param", "ranks"}: the gradient of `param` (a name in the model) is
multiplied by NaN in that micro-batch on those ranks; the step's boundary step() must refuse it:
recorded as "refused" (the error, the phase after it, and what the step changes, before that
step's first micro-batch and after the refusal), then zero_grad() drops the batch and training
goes on. `skip_steps`: steps whose data is never seen. Losses are recorded before step().
`data_world` (default: the world) is the number of ranks whose rows the whole job trains on,
split over this job's ranks (a 1-rank job resuming a 2-rank run takes both ranks' rows).
`hidden` (default HIDDEN): the width of the model's hidden layer.
"""

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's infinity

import infinity  # noqa: E402
from infinity.engine._overlap import UnitStepper  # noqa: E402

IN, HIDDEN, OUT = 7, 11, 5
MICRO = 3


def make_model(seed: int, hidden: int = HIDDEN) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, OUT))


def global_batch(step: int, micro: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch `micro` of step `step` over every rank: world * MICRO rows."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randn(world * MICRO, IN, generator=g), torch.randn(world * MICRO, OUT, generator=g)


def run_case(case: dict, rank: int, world: int) -> dict:
    # Ranks build different initial values: the engine must start every rank from rank 0's.
    if case.get("zero_init"):  # values created by initialize, from rank 0's
        with infinity.zero.Init(case["config"]):
            model = make_model(case.get("seed", 0) + rank, case.get("hidden", HIDDEN))
    else:
        model = make_model(case.get("seed", 0) + rank, case.get("hidden", HIDDEN))
    # Layer 0's bias lies in the second half of its unit: in rank 1's shard. An overflow there
    # on rank 1 alone reaches no other rank's shard; only the all-reduced norm tells them.
    overflow, poisoned = [False], [False]
    model[0].bias.register_hook(lambda g: g * float("inf") if overflow[0] else g)
    nan = case.get("nan")
    if nan is not None:
        model.get_parameter(nan["param"]).register_hook(
            lambda g: g * float("nan") if poisoned[0] else g)
    engine = infinity.initialize(model, case["config"])
    gas = engine.config.gradient_accumulation_steps
    data_world = case.get("data_world", world)
    rows_per_rank = data_world * MICRO // world
    rows = slice(rank * rows_per_rank, (rank + 1) * rows_per_rank)
    losses, record = [], {}
    try:
        if "load" in case:
            load = case["load"]
            engine.load_checkpoint(load[rank] if isinstance(load, list) else load)
            record["loaded"] = dict(engine.named_parameters())
            record["draw"] = torch.rand(4)  # the RNG state comes back with the checkpoint
        for step in range(engine.global_steps, case["steps"]):
            if step in case.get("skip_steps", ()):
                continue
            refusing = nan is not None and step == nan["step"]
            before = _snapshot(engine) if refusing else None
            for micro in range(gas):
                x, y = global_batch(step, micro, data_world)
                dtype = torch.float16 if engine.config.fp16.enabled else torch.float32
                loss = torch.nn.functional.mse_loss(engine(x[rows].to(dtype)), y[rows].to(dtype))
                overflow[0] = step == case.get("overflow_at_step") and rank == 1
                poisoned[0] = refusing and micro == nan["micro"] and rank in nan["ranks"]
                if step == case.get("die_at_step") and rank == 1:
                    os._exit(17)
                if step == case.get("stall_at_step") and rank == 1:
                    time.sleep(case["stall_s"])
                    os._exit(18)
                engine.backward(loss)
                losses.append(float(loss))
                if refusing and micro == gas - 1:
                    record["refused"] = _refuse(engine, before)
                else:
                    engine.step()
            record.setdefault("grad_norms", []).append(engine.last_grad_norm)
            if step + 1 == case.get("save_after"):
                engine.save_checkpoint(case["save"])
                record["saved"] = dict(engine.named_parameters())
                record["draw"] = torch.rand(4)
        params = dict(engine.named_parameters())
        stats = {**engine.stats()["optimizer"], "skipped_steps": engine.skipped_steps,
                 "device": engine.device.type,
                 "loss_scale": engine.stats()["loss_scale"],
                 "gathered_ahead": engine.stats()["prefetch"]["gathered_ahead"]}
        # What this rank holds: the optimizer's (numel, offset) per unit, gradient buffer sizes.
        owned = [(spec.numel, spec.offset) for spec in engine.optimizer.units]
        grads = [u.grad.numel for u in engine.units if u.requires_grad]
    finally:
        engine.close()
    return {"losses": losses, "params": params, "optimizer": stats, "owned": owned,
            "grads": grads, **record}


def _snapshot(engine) -> dict:
    """What a step changes on this rank: the values, the optimizer's state (moments, Adam's
    step), the counters and the learning rate (the schedule's position is in the counters),
    and the overlapped step's counts of units speculated and rolled back."""
    values = dict(engine.named_parameters())
    state = [(u, {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()})
             for u, s in engine.optimizer.iter_state()]
    optimizer = engine.stats()["optimizer"]
    return {"values": values, "state": state, "counters": dataclasses.asdict(engine.counters),
            "lr": engine.get_lr(), "speculation": {
                k: optimizer[k] for k in ("units_speculated", "rollbacks", "units_rolled_back")}}


def _refuse(engine, before: dict) -> dict:
    """step() at a boundary whose gradients hold a NaN (on some rank): how it failed, and what
    the step changes before (`before`) and after it; then zero_grad() drops the batch."""
    error = None
    try:
        engine.step()
    except infinity.NonFiniteGradientError as exc:
        error = [type(exc).__name__, str(exc)]
    phase = engine.phase.value
    engine.zero_grad()
    return {"error": error, "phase": phase, "before": before, "after": _snapshot(engine)}


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    results = {}
    for case in spec["cases"]:
        config = case["config"]
        if isinstance(config, list):  # one config per rank (a mismatch)
            case = {**case, "config": config[rank]}
        withdraw = UnitStepper.withdraw
        if case.get("patient_worker"):
            UnitStepper.withdraw = lambda self: None
        try:
            results[case["name"]] = run_case(case, rank, world)
        except (infinity.ConfigError, infinity.CheckpointError, OSError) as exc:
            results[case["name"]] = {"error": [c.__name__ for c in type(exc).__mro__],
                                     "message": str(exc)}
        finally:
            UnitStepper.withdraw = withdraw
    torch.save(results, os.path.join(spec["out"], f"rank{rank}.pt"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
