"""Data-parallel ranks (gloo, 2 processes with torchrun's environment): ZeRO stages 0-3 with
offload none / nvme train exactly as one process on the concatenated batch (plain PyTorch +
AdamW, <= 1e-5 relative on losses and parameters, fp32, 10 steps), with clipping and gradient
accumulation; mismatched configs and a batch size that ignores the world are refused on every
rank; a killed rank ends the other with RankError naming it, not a hang. A NaN in one unit's
gradient (on both ranks, or on one) is refused on every rank with nothing changed, the
speculated units rolled back, and training goes on as if the batch had never been seen.

All parity cases run in one torchrun launch (one child process per rank runs them in turn; see
_ranks_child.py) to pay the processes' start once. The lost-rank tests start the ranks with
torchrun's environment by hand, to see each rank's exit code and output.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from children import ROOT, child_env, python_child, torchrun

import infinity

sys.path.insert(0, str(Path(__file__).parent))
from _ranks_child import MICRO, global_batch, make_model  # noqa: E402

# One worker runs this module: its fixture runs once (--dist=loadgroup in pyproject.toml).
pytestmark = pytest.mark.xdist_group("engine_ranks")

CHILD = Path(__file__).parent / "_ranks_child.py"
WORLD = 2
STEPS = 10
LR, WEIGHT_DECAY, CLIP = 1e-2, 0.01, 0.05  # CLIP is below the gradient norm: every step clips


ALWAYS = {"infinity": {"collective_timeout": 60, "speculate": "always"}}


def _config(stage, *, nvme=None, clip=0.0, gas=1, **extra):
    zero = {"stage": stage, "stage3_param_persistence_threshold": 10, "sub_group_size": 32}
    if nvme is not None:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": str(nvme)}
        if stage == 3:
            zero["offload_param"] = {"device": "nvme", "nvme_path": str(nvme)}
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
            "gradient_clipping": clip, "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "infinity": {"collective_timeout": 60}, **extra}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spec(tmp_path, cases):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "cases": cases}))
    return spec, out


def _results(out, world=WORLD):
    return [torch.load(out / f"rank{r}.pt") if (out / f"rank{r}.pt").exists() else None
            for r in range(world)]


def _torchrun(tmp_path, cases, timeout_s, world=WORLD):
    """Run the child on `world` ranks with torchrun; returns (its exit code and output, per-rank
    results)."""
    spec, out = _spec(tmp_path, cases)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}  # torchrun's log dirs
    run = python_child([*torchrun(world), str(CHILD), str(spec)], env=env, timeout=timeout_s)
    return (run.returncode, run.stdout + run.stderr), _results(out, world)


def _launch(tmp_path, cases, timeout_s, wait_for=WORLD):
    """Run the child on WORLD processes with torchrun's environment, each rank's output apart;
    returns (returncode, stderr) of the first `wait_for` ranks, then the return codes of the
    others, killed once those ended (-SIGKILL if they were still running)."""
    spec, _ = _spec(tmp_path, cases)
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = child_env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, str(CHILD), str(spec)], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + timeout_s
    done = []
    try:
        for p in procs[:wait_for]:
            _, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            done.append((p.returncode, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return done + [p.returncode for p in procs[wait_for:]]


def _reference(config, steps, skip=()):
    """Plain PyTorch on the concatenated batch of every rank, never seeing the data of the
    steps in `skip`, with the config's WarmupLR: (micro-batch losses, params)."""
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    schedule = config.get("scheduler")
    schedule = schedule and infinity.optim.WarmupLR(**schedule["params"])
    gas = config["gradient_accumulation_steps"]
    losses = []
    for step in range(steps):
        if step in skip:
            continue
        if schedule:  # the engine's: the schedule moves on after each applied step
            opt.param_groups[0]["lr"] = schedule.lr_at(len(losses) // gas - 1)
        for micro in range(gas):
            x, y = global_batch(step, micro, WORLD)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / gas).backward()
            losses.append(loss.item())
        if config["gradient_clipping"]:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config["gradient_clipping"])
        opt.step()
        opt.zero_grad()
    return losses, dict(model.named_parameters())


def _relative(a, b):
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


PARITY = {  # name -> config(nvme path)
    "stage0": lambda nvme: _config(0),
    "stage1-clip": lambda nvme: _config(1, clip=CLIP),
    "stage1-nvme": lambda nvme: _config(1, nvme=nvme),
    "stage2-clip-gas2": lambda nvme: _config(2, clip=CLIP, gas=2),
    "stage2-nvme": lambda nvme: _config(2, nvme=nvme),
    "stage3": lambda nvme: _config(3),
    "stage3-clip": lambda nvme: _config(3, clip=CLIP),
    "stage3-nvme-gas2": lambda nvme: _config(3, nvme=nvme, gas=2),
    # overlapped with clipping: speculated at every step ("always"; "auto" would not speculate
    # after a step where clipping acted), then rolled back and redone (clipping acts)
    "stage2-nvme-clip-gas2": lambda nvme: _config(2, nvme=nvme, clip=CLIP, gas=2, **ALWAYS),
    "stage3-nvme-clip": lambda nvme: _config(3, nvme=nvme, clip=CLIP, **ALWAYS),
}


NORM_TWINS = ["stage2-nvme", "stage3-nvme-gas2"]  # overlapped (gradients reduce-scattered)
SPECULATED_TWINS = ["stage2-nvme-clip-gas2", "stage3-nvme-clip"]
STEPPED_AFTER = {"infinity": {"collective_timeout": 60, "overlap_optimizer": False}}


# A NaN in one unit's gradient at step NAN_STEP, parameters and optimizer on NVMe, the plain
# overlapped step (no clipping), accumulation, a WarmupLR schedule still warming up. At stage 3
# two units are handed over in backward: layer 2's weight, then layer 0 (weight and bias).
NAN_STEPS, NAN_STEP = 6, 2
NAN_CONFIG = lambda nvme: _config(  # noqa: E731
    3, nvme=nvme, gas=2, scheduler={"type": "WarmupLR", "params": {
        "warmup_min_lr": LR / 10, "warmup_max_lr": LR, "warmup_num_steps": 4,
        "warmup_type": "linear"}})
NANS = {  # name -> (the NaN, per rank: the units speculated then rolled back in its step)
    # on both ranks, in the first micro-batch: both shards of layer 2's weight hold it (their
    # step fails on the worker), layer 0 is speculated
    "nan": ({"step": NAN_STEP, "micro": 0, "param": "2.weight", "ranks": [0, 1]}, [1, 1]),
    # on rank 1 only, in layer 0's bias (rank 1's shard): rank 0's gradients are all finite,
    # both its units are speculated; only the all-reduced count tells it to refuse
    "nan-on-rank-1": ({"step": NAN_STEP, "micro": 1, "param": "0.bias", "ranks": [1]}, [2, 1]),
}


@pytest.fixture(scope="module")
def ranks_run(tmp_path_factory):
    """One launch of every case below on 2 ranks, with torchrun."""
    tmp_path = tmp_path_factory.mktemp("ranks")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    cases = [{"name": name, "config": make(nvme), "steps": STEPS, "patient_worker": True}
             for name, make in PARITY.items()]
    cases += [
        {"name": "mismatch", "steps": 1,
         "config": [_config(1), _config(1, clip=CLIP)]},
        {"name": "batch", "steps": 1,
         "config": {**_config(1), "train_batch_size": MICRO}},  # as if one rank
        {"name": "zero-init", "steps": STEPS, "config": _config(0), "zero_init": True},
        {"name": "fp16-overflow", "steps": 4, "overflow_at_step": 2,
         "config": _config(3, fp16={"enabled": True, "initial_scale_power": 8, "hysteresis": 1})},
    ]
    # The overlapped cases stepped after backward (with clipping that never acts).
    cases += [{"name": f"{name}-after", "steps": STEPS,
               "config": PARITY[name](nvme) | {"gradient_clipping": 1e3} | STEPPED_AFTER}
              for name in NORM_TWINS]
    cases += [{"name": f"{name}-after", "steps": STEPS,
               "config": PARITY[name](nvme) | STEPPED_AFTER} for name in SPECULATED_TWINS]
    cases += [{"name": name + suffix, "steps": NAN_STEPS, "patient_worker": True, "nan": nan,
               "config": NAN_CONFIG(nvme) | extra}
              for name, (nan, _) in NANS.items()
              for suffix, extra in (("", {}), ("-after", STEPPED_AFTER))]
    cases.append({"name": "nan-never-seen", "steps": NAN_STEPS, "patient_worker": True,
                  "skip_steps": [NAN_STEP], "config": NAN_CONFIG(nvme)})
    (code, output), results = _torchrun(tmp_path, cases, timeout_s=240)
    assert code == 0, f"torchrun exited {code}:\n{output[-3000:]}"
    return results, nvme


@pytest.mark.parametrize("name", list(PARITY))
def test_ranks_match_one_process_on_the_concatenated_batch(ranks_run, name):
    results, nvme = ranks_run
    config = PARITY[name](nvme)
    ref_losses, ref_params = _reference(config, STEPS)
    per_rank = [r[name] for r in results]
    for r in per_rank:
        assert "error" not in r, r
    # The loss over the concatenated batch is the mean of the ranks' (equal-sized) losses.
    losses = torch.tensor([r["losses"] for r in per_rank]).mean(0)
    assert _relative(losses, torch.tensor(ref_losses)) <= 1e-5
    for rank, r in enumerate(per_rank):
        assert r["params"].keys() == ref_params.keys()
        for key, ref in ref_params.items():
            assert _relative(r["params"][key], ref.detach()) <= 1e-5, (rank, key)
    assert torch.equal(torch.cat([p.flatten() for p in per_rank[0]["params"].values()]),
                       torch.cat([p.flatten() for p in per_rank[1]["params"].values()]))
    # Units (in order): layer 0 (weight + bias, 88), layer 2's weight (55), the resident bias (5)
    # at stage 3; below it one resident unit of every parameter (148).
    stage = config["zero_optimization"]["stage"]
    numels = [88, 55, 5] if stage == 3 else [148]
    shards = [-(-n // WORLD) for n in numels]
    slices = [[(74, 0)], [(74, 74)]]  # each rank steps its own slice of the values entry
    owned = {0: [[(148, 0)]] * WORLD, 1: slices, 2: slices,
             3: [[(s, 0) for s in shards]] * WORLD}[stage]  # the padded shard entry
    assert [r["owned"] for r in per_rank] == owned
    grads = {0: numels, 1: numels, 2: shards, 3: shards}[stage]  # gradients partitioned from 2
    assert [r["grads"] for r in per_rank] == [grads] * WORLD
    # Stage 3 gathers the next unit while a module computes (from step 2, along the trace).
    assert (per_rank[0]["optimizer"]["gathered_ahead"] > 0) is (stage == 3)
    # "auto" overlaps where anything is on NVMe, or on an accelerator
    on_nvme = "offload_optimizer" in config["zero_optimization"]
    overlapped = on_nvme or per_rank[0]["optimizer"]["device"] != "cpu"
    assert per_rank[0]["optimizer"]["overlap"] is overlapped
    if overlapped and config["zero_optimization"]["stage"] == 3:  # (below 3 every unit is resident)
        # units were stepped on the worker during backward
        assert per_rank[0]["optimizer"]["units_stepped_in_backward"] > 0


def test_ranks_refuse_configs_that_differ(ranks_run):
    results, _ = ranks_run
    for r in results:
        assert "ConfigError" in r["mismatch"]["error"]
        assert "differs between ranks: rank(s) [1] differ from rank 0" in r["mismatch"]["message"]


def test_a_batch_size_that_ignores_the_world_is_refused(ranks_run):
    results, _ = ranks_run
    for r in results:
        assert "ConfigError" in r["batch"]["error"]
        assert "world_size = 3 * 1 * 2 = 6" in r["batch"]["message"]


@pytest.mark.parametrize("stage, how", [(3, "dies"), (1, "stalls")])
def test_a_lost_rank_ends_the_other_with_an_error_naming_it(tmp_path, stage, how):
    """Rank 1 dies (or stalls past collective_timeout) after a forward; rank 0 is then in a
    collective (all-reduce or reduce-scatter in backward, all-gather in forward) and must stop
    with RankError naming rank 1, not hang."""
    case = {"name": "lost", "steps": 4, "config": _config(stage)}
    if how == "dies":
        case["die_at_step"] = 2
    else:
        # rank 1 stalls far longer than the test may wait: only the timeout can end rank 0
        case.update(stall_at_step=2, stall_s=3600,
                    config=_config(stage, infinity={"collective_timeout": 3}))
    done = _launch(tmp_path, [case], timeout_s=240, wait_for=1 if how == "stalls" else WORLD)
    (code0, stderr0) = done[0]
    assert code0 != 0
    assert "infinity.errors.RankError: rank 0 of 2:" in stderr0, stderr0[-3000:]
    assert "rank(s) [1] did not answer" in stderr0, stderr0[-3000:]
    if how == "dies":
        assert done[1][0] == 17
    else:  # rank 0 gave up after the timeout while rank 1 still stalled (killed then)
        assert done[1] == -signal.SIGKILL


def test_a_loaded_model_is_refused_at_stage_3_on_several_ranks():
    """A store from infinity.models.load holds whole units; the model keeps it for a retry."""
    from infinity.config import load_config
    from infinity.engine._placement import Placed, take_placed

    model = make_model(0)
    placed = Placed(layout=None, store=None)
    model.infinity_placed = placed
    config = load_config(_config(3), world_size=WORLD)
    with pytest.raises(infinity.ConfigError,
                       match="stage 3 with 2 ranks cannot adopt a model from infinity.models.load"):
        take_placed(model, config, None, None, sharded_params=True)
    assert model.infinity_placed is placed


def test_a_model_built_under_zero_init_trains_as_one_on_every_rank(ranks_run):
    """Each rank's initialisers draw other values (seeds differ); the store gets rank 0's."""
    results, _ = ranks_run
    first, second = (r["zero-init"] for r in results)
    assert first["params"].keys() == second["params"].keys()
    for key, value in first["params"].items():
        assert torch.equal(value, second["params"][key]), key
    # the training of one process from rank 0's values (make_model(0)), not rank 1's
    ref_losses, ref_params = _reference(_config(0), STEPS)
    losses = torch.tensor([first["losses"], second["losses"]]).mean(0)
    assert _relative(losses, torch.tensor(ref_losses)) <= 1e-5
    for key, ref in ref_params.items():
        assert _relative(first["params"][key], ref.detach()) <= 1e-5, key


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(ranks_run):
    """fp16: rank 1's gradients overflow at step 2; the all-reduced norm is inf on both ranks,
    so both skip that step and lower the loss scale alike, and stay one model."""
    results, _ = ranks_run
    first, second = (r["fp16-overflow"] for r in results)
    for r in (first, second):
        assert "error" not in r, r
        assert r["optimizer"]["skipped_steps"] == 1
        assert r["optimizer"]["loss_scale"] == 2.0 ** 8 / 2
    for key, value in first["params"].items():
        assert torch.equal(value, second["params"][key]), key


@pytest.mark.parametrize("name", SPECULATED_TWINS)
def test_speculated_steps_on_two_ranks_equal_the_step_after_backward(ranks_run, name):
    """Clipping acts at every step: each rank's speculated units are rolled back and redone
    with the clip factor of the norm over every rank's shard, bit for bit the step after
    backward on each rank."""
    results, _ = ranks_run
    for r in results:
        assert "error" not in r[name] and "error" not in r[f"{name}-after"]
        assert r[name]["optimizer"]["overlap"] and not r[f"{name}-after"]["optimizer"]["overlap"]
        assert r[name]["losses"] == r[f"{name}-after"]["losses"]
        for key, value in r[f"{name}-after"]["params"].items():
            assert torch.equal(r[name]["params"][key], value), key
        optimizer = r[name]["optimizer"]
        assert optimizer["units_rolled_back"] == optimizer["units_speculated"]
        # stage 3: two units a step are handed over in backward (below it every unit is
        # resident: stepped after validation, nothing speculated)
        assert optimizer["units_speculated"] == (2 * STEPS if "stage3" in name else 0)


@pytest.mark.parametrize("name", NORM_TWINS)
def test_the_overlapped_step_reports_the_norm_over_every_ranks_shard(ranks_run, name):
    """The overlapped step sums its units' squares over the ranks' shards: every rank reports
    the norm the step after backward reports (with clipping, here never acting), to the bit,
    and torch's on the whole batch."""
    results, nvme = ranks_run
    for r in results:
        assert r[name]["optimizer"]["overlap"] and not r[f"{name}-after"]["optimizer"]["overlap"]
        norms = r[name]["grad_norms"]
        assert norms == r[f"{name}-after"]["grad_norms"] == results[0][name]["grad_norms"]
    config = PARITY[name](nvme)
    model = make_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    gas, reference = config["gradient_accumulation_steps"], []
    for step in range(STEPS):
        for micro in range(gas):
            x, y = global_batch(step, micro, WORLD)
            (torch.nn.functional.mse_loss(model(x), y) / gas).backward()
        reference.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
        opt.step()
        opt.zero_grad()
    torch.testing.assert_close(results[0][name]["grad_norms"], reference, rtol=1e-5, atol=0)


def _assert_same(a, b, what):
    """Two snapshots of what a step changes (_ranks_child._snapshot) are equal, bit for bit."""
    assert a["values"].keys() == b["values"].keys()
    for key, value in a["values"].items():
        assert torch.equal(value, b["values"][key]), (what, key)
    for (u, state_a), (_, state_b) in zip(a["state"], b["state"], strict=True):
        assert state_a.keys() == state_b.keys()
        for key, value in state_a.items():
            same = torch.equal(value, state_b[key]) if torch.is_tensor(value) else \
                value == state_b[key]
            assert same, (what, u, key)
    assert (a["counters"], a["lr"]) == (b["counters"], b["lr"]), what


@pytest.mark.parametrize("name", list(NANS))
def test_a_nan_on_two_ranks_changes_nothing_and_training_goes_on(ranks_run, name):
    """The boundary step() raises NonFiniteGradientError on every rank (also on rank 0 when
    only rank 1's gradient holds the NaN), with every speculated unit rolled back: values,
    moments, Adam's step, counters (the refused step() only ends its accumulation), learning
    rate as before the step's first micro-batch. After zero_grad() training goes on: bit for
    bit the stepped-after-backward engine, and the run that never saw that step's batch, and
    plain PyTorch on the concatenated batch without it within 1e-5."""
    results, nvme = ranks_run
    rolled_back = NANS[name][1]
    for rank, r in enumerate(results):
        run, after, unseen = r[name], r[f"{name}-after"], r["nan-never-seen"]
        for record in (run, after, unseen):
            assert "error" not in record, record
        assert run["optimizer"]["overlap"] and not after["optimizer"]["overlap"]
        for record in (run, after):
            refused = record["refused"]
            assert refused["error"] is not None, (rank, "step() took the NaN step")
            kind, message = refused["error"]
            assert kind == "NonFiniteGradientError" and refused["phase"] == "idle"
            if name == "nan-on-rank-1" and rank == 0:  # its own gradients are all finite
                assert "in another rank: the step was not taken" in message
            before = refused["before"]
            ended = {**before, "counters": {**before["counters"],
                                            "micro_steps": before["counters"]["micro_steps"] + 2}}
            _assert_same(refused["after"], ended, (rank, "the refused step changed something"))
        _assert_same(run["refused"]["after"], after["refused"]["after"], (rank, "after backward"))
        # every unit speculated in the refused step was rolled back; the other steps committed
        spec_before, spec_after = (run["refused"][k]["speculation"] for k in ("before", "after"))
        moved = {k: spec_after[k] - spec_before[k] for k in spec_before}
        assert moved == {"units_speculated": rolled_back[rank], "rollbacks": 1,
                         "units_rolled_back": rolled_back[rank]}, rank
        assert run["optimizer"]["rollbacks"] == 1
        assert run["optimizer"]["units_speculated"] == 2 * (NAN_STEPS - 1) + rolled_back[rank]
        # training went on: the stepped-after-backward engine, the run without the batch
        assert run["losses"] == after["losses"]
        seen = [loss for k, loss in enumerate(run["losses"]) if k // 2 != NAN_STEP]
        assert seen == unseen["losses"]
        for key, value in run["params"].items():
            assert torch.equal(value, after["params"][key]), (rank, key)
            assert torch.equal(value, unseen["params"][key]), (rank, key)
    for key, value in results[0][name]["params"].items():
        assert torch.equal(value, results[1][name]["params"][key]), key
    config = NAN_CONFIG(nvme)
    ref_losses, ref_params = _reference(config, NAN_STEPS, skip={NAN_STEP})
    losses = torch.tensor([r["nan-never-seen"]["losses"] for r in results]).mean(0)
    assert _relative(losses, torch.tensor(ref_losses)) <= 1e-5
    for key, ref in ref_params.items():
        assert _relative(results[0][name]["params"][key], ref.detach()) <= 1e-5, key
