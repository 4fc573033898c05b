"""Training killed with SIGKILL (inside optimizer steps and inside checkpoint saves), 20 times,
each time resumed from `latest`, ends with exactly the weights of an uninterrupted run.

One child process imports torch and infinity once and forks a grandchild per attempt (forking
before any engine, zarr or aio thread exists in the child). An uninterrupted run first counts
the durability steps of a save (fsync, rename) and the units' optimizer steps of a step; each
of the next 20 attempts then kills itself at a drawn one of them, alternately inside the first
save after its start and inside the step after that save (where, it notes in kills.jsonl
first), so every kill lands, and one last attempt runs to the end. A kill in a step always
resumes two steps further, so the kills spread over the run whatever the timing (which step a
unit's update lands in is not fixed: the optimizer worker may finish a step's last unit during
the next forward); resuming the same checkpoint again is what a save killed before its commit
does. With clipping the units are stepped speculatively during backward, then rolled back and
redone (clipping acts at every step): the kills land in speculated steps and in redone ones.
"""

import json
import os
import signal

import pytest
import torch
from children import python_child

KILLS = 20

CHILD = r"""
import json, os, random, signal, sys
import torch
import infinity
from infinity.checkpoint import latest_tag

ROOT, KILLS, CLIP = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
if CLIP:  # every unit handed over in backward is speculated, however far behind the worker is
    from infinity.engine._overlap import UnitStepper
    UnitStepper.withdraw = lambda self: None
STEPS = 2 * KILLS + 6  # an attempt gets at most one save further: every kill has work to land in

def config(swap):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "sub_group_size": 64,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": swap}},
            "infinity": {"host_memory_budget": "1GB", "speculate": "always"}}

def counted(engine, kill):
    # Counts this attempt's save durability steps and unit steps; SIGKILL at kill = (where, n).
    counts, saving, per_save = {"save": 0, "step": 0}, [False], []

    def count(where, real):
        def call(*args, **kwargs):
            if per_save if where == "step" else saving[0]:  # steps after the first save
                counts[where] += 1
                if kill == (where, counts[where]):
                    with open(os.path.join(ROOT, "kills.jsonl"), "a") as f:
                        f.write(json.dumps({"where": where, "n": counts[where], "saving": saving[0],
                                            "global_steps": engine.global_steps}) + "\n")
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return call

    os.fsync, os.replace, os.rename = (count("save", f) for f in (os.fsync, os.replace, os.rename))
    engine.optimizer.step_unit = count("step", engine.optimizer.step_unit)
    save = engine.save_checkpoint

    def save_checkpoint(*args, **kwargs):
        saving[0], before = True, counts["save"]
        try:
            return save(*args, **kwargs)
        finally:
            saving[0] = False
            per_save.append(counts["save"] - before)

    engine.save_checkpoint = save_checkpoint
    return counts, per_save

def train(run, out, kill):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 4))
    engine = infinity.initialize(model, config(os.path.join(ROOT, "swap")))
    torch.manual_seed(1)
    if latest_tag(run) is not None:
        engine.load_checkpoint(run)
    counts, per_save = counted(engine, kill)
    while engine.global_steps < STEPS:
        x = torch.randn(2, 8)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        if engine.global_steps % 2 == 0:
            engine.save_checkpoint(run)
    torch.save(dict(engine.named_parameters()), out)
    engine.close()
    with open(out + ".json", "w") as f:
        json.dump({"save": min(per_save), "step": counts["step"] // (STEPS - 2)}, f)

def attempt(run, out, kill=None):
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            train(run, out, kill)
        except BaseException:
            import traceback; traceback.print_exc()
            code = 3
        os._exit(code)
    return os.waitpid(pid, 0)[1]

os.makedirs(os.path.join(ROOT, "swap"))
reference = os.path.join(ROOT, "reference.pt")
assert attempt(os.path.join(ROOT, "reference"), reference) == 0
per = json.load(open(reference + ".json"))  # durability steps of a save, unit steps of a step
rng = random.Random(11)
# Inside the first save after the start, or inside the step after it: an attempt gets at most
# one save (two steps) further than the last.
plan = [("save", rng.randint(1, per["save"])) if i % 2 == 0 else
        ("step", rng.randint(1, per["step"])) for i in range(KILLS)]
run, out = os.path.join(ROOT, "run"), os.path.join(ROOT, "resumed.pt")
statuses = [attempt(run, out, kill) for kill in plan]
statuses.append(attempt(run, out))
print(json.dumps({"statuses": statuses, "plan": plan, "per": per}))
"""


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_sigkilled_training_resumes_to_the_uninterrupted_weights(tmp_path, clip):
    out = python_child(["-c", CHILD, str(tmp_path), str(KILLS), str(clip)], timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.splitlines()[-1])
    *killed, last = report["statuses"]
    assert last == 0, out.stderr[-3000:]
    assert all(os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGKILL for s in killed), (
        report, out.stderr[-3000:])
    kills = [json.loads(line) for line in (tmp_path / "kills.jsonl").read_text().splitlines()]
    assert [[k["where"], k["n"]] for k in kills] == report["plan"]  # each died where drawn
    assert all(k["saving"] for k in kills if k["where"] == "save")  # half of them in a save
    in_steps = [k["global_steps"] for k in kills if k["where"] == "step"]
    assert in_steps == sorted(set(in_steps)), kills  # each a save further: spread over the run
    reference = torch.load(tmp_path / "reference.pt")
    resumed = torch.load(tmp_path / "resumed.pt")
    assert reference.keys() == resumed.keys()
    for name, tensor in reference.items():
        assert torch.equal(resumed[name], tensor), name
