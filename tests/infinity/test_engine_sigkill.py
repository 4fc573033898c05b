"""Training killed with SIGKILL at random moments (inside steps and inside checkpoint saves), 20
times, each time resumed from `latest`, ends with exactly the weights of an uninterrupted run.

One child process imports torch and infinity once and forks a grandchild per attempt (forking
before any engine, zarr or aio thread exists in the child); the child kills each of the first
20 attempts after a random delay, then lets one run to the end.
"""

import json
import os

import torch
from children import python_child

CHILD = r"""
import json, os, random, signal, sys, time
import torch
import infinity
from infinity.checkpoint import latest_tag

ROOT, KILLS, STEPS = sys.argv[1], int(sys.argv[2]), 40

def config(swap):
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 64,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": swap}},
            "infinity": {"host_memory_budget": "1GB"}}

def train(run, out):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                torch.nn.Linear(32, 4))
    engine = infinity.initialize(model, config(os.path.join(ROOT, "swap")))
    torch.manual_seed(1)
    if latest_tag(run) is not None:
        engine.load_checkpoint(run)
    while engine.global_steps < STEPS:
        x = torch.randn(2, 8)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
        if engine.global_steps % 2 == 0:
            engine.save_checkpoint(run)
    torch.save(dict(engine.named_parameters()), out)
    engine.close()

def attempt(run, out, delay_s=None):
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            train(run, out)
        except BaseException:
            import traceback; traceback.print_exc()
            code = 3
        os._exit(code)
    if delay_s is not None:
        time.sleep(delay_s)
        os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]

os.makedirs(os.path.join(ROOT, "swap"))
start = time.perf_counter()
assert attempt(os.path.join(ROOT, "reference"), os.path.join(ROOT, "reference.pt")) == 0
full_s = time.perf_counter() - start
start = time.perf_counter()  # start-up and load alone: the finished run has nothing left to do
assert attempt(os.path.join(ROOT, "reference"), os.path.join(ROOT, "again.pt")) == 0
init_s = time.perf_counter() - start
rng = random.Random(11)
run, out = os.path.join(ROOT, "run"), os.path.join(ROOT, "resumed.pt")
# Each attempt lives through its start-up and then, on average, 1/(KILLS + 5) of the training:
# the kills land at random points of steps and saves, and the run is not finished before them.
work_s = max(full_s - init_s, 0.1) / (KILLS + 5)
statuses = [attempt(run, out, init_s + rng.uniform(0, 2 * work_s)) for _ in range(KILLS)]
statuses.append(attempt(run, out))
print(json.dumps({"statuses": statuses, "full_s": full_s, "init_s": init_s}))
"""


def test_sigkilled_training_resumes_to_the_uninterrupted_weights(tmp_path):
    out = python_child(["-c", CHILD, str(tmp_path), "20"], timeout=280)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.splitlines()[-1])
    *killed, last = report["statuses"]
    assert last == 0, out.stderr[-3000:]
    assert all(os.WIFSIGNALED(s) or s == 0 for s in killed), (report, out.stderr[-3000:])
    # Kill times come from a timing measured once; on a loaded machine a few attempts finish
    # (or die in start-up) before their kill, so ask for a clear majority, not all.
    assert sum(os.WIFSIGNALED(s) for s in killed) >= 10, f"too few kills landed: {report}"
    reference = torch.load(tmp_path / "reference.pt")
    resumed = torch.load(tmp_path / "resumed.pt")
    assert reference.keys() == resumed.keys()
    for name, tensor in reference.items():
        assert torch.equal(resumed[name], tensor), name
