"""A kill -9 while the overlapped step is validated (issue 22): between backward's end and the
commit/rollback decision, inside a speculated unit's rollback, between two units' commits,
with the plain overlapped step and with clipping (which rolls every step back and redoes it),
a refused NaN step among them. Each attempt resumes from the last checkpoint saved before it
and the last one trains to the end: bit for bit the uninterrupted run (which saves nothing),
itself bit for bit the stepped-after-backward engine.

One child process imports torch and infinity once and forks a grandchild per run (before any
engine thread exists in the child). Each kill is deterministic: the grandchild SIGKILLs itself
from a wrapper at a named point, the n-th time it gets there, and notes where first:
- "validate": `OverlappedStep.end_speculation` returned (backward is over, every unit handed
  over was stepped speculatively and waited for; nothing committed or rolled back yet);
- "rollback": a unit stepped speculatively is being rolled back: its kept values are copied
  back into its values entry, its tiles not rolled back yet (`optimizer.tiles.roll_back`);
- "commit": `optimizer.commit_unit`, after the commits before it in the step.
"""

import json
import os
import signal

import torch
from children import python_child

CHILD = r"""
import json, os, signal, sys
import torch
import infinity
from infinity.checkpoint import latest_tag
from infinity.engine._overlap import OverlappedStep, UnitStepper

ROOT = sys.argv[1]
BATCHES, NAN_BATCH = 8, 4  # a checkpoint after every second batch; batch 4's gradient has a NaN
# Every unit handed over in backward is stepped speculatively, however far behind the worker
# is: the n-th commit or rollback is the same unit in every run.
UnitStepper.withdraw = lambda self: None
PLANS = {  # clipping -> the attempts' kills, (where, n) counted from the attempt's start
    0.0: [("validate", 3), ("rollback", 1), ("commit", 2)],
    0.05: [("validate", 3), ("rollback", 5), ("validate", 2)],
}
now = {"run": None, "batch": None, "kill": None, "counts": {}}

def log(entry):
    with open(os.path.join(ROOT, "events.jsonl"), "a") as f:
        f.write(json.dumps(entry) + "\n")

def hit(where):
    counts = now["counts"]
    counts[where] = counts.get(where, 0) + 1
    if now["kill"] == (where, counts[where]):
        log({"run": now["run"], "kill": [where, counts[where], now["batch"]]})
        os.kill(os.getpid(), signal.SIGKILL)

end_speculation = OverlappedStep.end_speculation

def end_speculation_then_hit(self):
    units = end_speculation(self)
    hit("validate")
    return units

OverlappedStep.end_speculation = end_speculation_then_hit

def arm(engine, kill):
    # After the load (which commits every unit): count from here.
    now["kill"], now["counts"] = kill, {}
    optimizer, tiles = engine.optimizer, engine.optimizer.tiles
    commit, roll_back = optimizer.commit_unit, tiles.roll_back

    def commit_unit(u):
        hit("commit")
        commit(u)

    def tiles_roll_back(u):  # (rollback_unit has copied the kept values back)
        if not tiles.pending(u, optimizer.begin_step()):  # stepped speculatively
            hit("rollback")
        roll_back(u)

    optimizer.commit_unit, tiles.roll_back = commit_unit, tiles_roll_back

def config(clip, overlap):
    swap = os.path.join(ROOT, "swap")
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                  "sub_group_size": 64,
                                  "offload_param": {"device": "nvme", "nvme_path": swap},
                                  "offload_optimizer": {"device": "nvme", "nvme_path": swap}},
            # "always": with clipping acting at every step, every step still speculates (and
            # rolls back), so each has a validation and a rollback to be killed in
            "infinity": {"host_memory_budget": "1GB", "overlap_optimizer": overlap,
                         "speculate": "always"}}

def train(run, out, clip, overlap, kill, save):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    poisoned = [False]  # the last Linear's weight: its unit's gradient is final first
    model[2].weight.register_hook(lambda g: g * float("nan") if poisoned[0] else g)
    engine = infinity.initialize(model, config(clip, overlap))
    assert engine.overlap is overlap
    start = 0
    if latest_tag(run) is not None:
        start = engine.load_checkpoint(run)["batch"]
    now["run"] = os.path.basename(run)
    log({"run": now["run"], "start": start})
    arm(engine, kill)
    for batch in range(start, BATCHES):
        now["batch"] = batch
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(batch))
        poisoned[0] = batch == NAN_BATCH
        engine.backward(engine(x).square().mean())
        try:
            engine.step()
        except infinity.NonFiniteGradientError:
            assert batch == NAN_BATCH
            engine.zero_grad()
        if save and batch % 2 == 1 and batch + 1 < BATCHES:  # (saves cost fsyncs)
            engine.save_checkpoint(run, tag=f"batch{batch + 1}", client_state={"batch": batch + 1})
    torch.save(dict(engine.named_parameters()), out)
    speculated = engine.stats()["optimizer"]["units_speculated"]
    engine.close()
    return speculated

def attempt(run, out, clip, overlap=True, kill=None, save=True):
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            speculated = train(run, out, clip, overlap, kill, save)
            log({"run": os.path.basename(run), "speculated": speculated})
        except BaseException:
            import traceback; traceback.print_exc()
            code = 3
        os._exit(code)
    return os.waitpid(pid, 0)[1]

os.makedirs(os.path.join(ROOT, "swap"))
statuses = {}
for clip, plan in PLANS.items():
    name = f"clip{clip}"
    path = lambda what: os.path.join(ROOT, f"{name}-{what}")
    after = attempt(path("after"), path("after.pt"), clip, overlap=False, save=False)
    reference = attempt(path("reference"), path("reference.pt"), clip, save=False)
    resumed = [attempt(path("run"), path("resumed.pt"), clip, kill=tuple(kill)) for kill in plan]
    resumed.append(attempt(path("run"), path("resumed.pt"), clip))
    statuses[name] = {"after": after, "reference": reference, "resumed": resumed}
print(json.dumps(statuses))
"""

# clipping -> the kills as they happened (where, n, batch) and each resumed attempt's start:
# the batch after the last checkpoint saved before its kill
EXPECTED = {
    "clip0.0": {  # committed but batch 4 (NaN: refused, layer 0 rolled back, layer 2 failed)
        "kills": [["validate", 3, 2], ["rollback", 1, 4], ["commit", 2, 5]],
        "starts": [0, 2, 4, 4]},
    "clip0.05": {  # every step rolled back and redone; the fifth rollback is batch 4's (NaN)
        "kills": [["validate", 3, 2], ["rollback", 5, 4], ["validate", 2, 5]],
        "starts": [0, 2, 4, 4]},
}


def test_a_kill_during_validation_resumes_from_the_last_committed_checkpoint(tmp_path):
    out = python_child(["-c", CHILD, str(tmp_path)], timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    statuses = json.loads(out.stdout.splitlines()[-1])
    for status in statuses.values():
        *killed, last = status["resumed"]
        assert status["after"] == status["reference"] == last == 0, out.stderr[-3000:]
        assert all(os.WIFSIGNALED(s) and os.WTERMSIG(s) == signal.SIGKILL for s in killed), (
            status, out.stderr[-3000:])
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    for name, expected in EXPECTED.items():
        run = [e for e in events if e["run"] == f"{name}-run"]
        assert [e["kill"] for e in run if "kill" in e] == expected["kills"], run
        assert [e["start"] for e in run if "start" in e] == expected["starts"], run
        # the uninterrupted run speculated 2 units a step, 1 in the NaN step (the other failed)
        assert [e["speculated"] for e in events if e["run"] == f"{name}-reference" and
                "speculated" in e] == [7 * 2 + 1]
        after = torch.load(tmp_path / f"{name}-after.pt")
        reference = torch.load(tmp_path / f"{name}-reference.pt")
        resumed = torch.load(tmp_path / f"{name}-resumed.pt")
        assert after.keys() == reference.keys() == resumed.keys()
        for key, value in reference.items():
            assert torch.equal(value, after[key]), (name, key)
            assert torch.equal(resumed[key], value), (name, key)
