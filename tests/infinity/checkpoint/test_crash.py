"""A checkpoint save killed with SIGKILL at any moment: `latest` names a complete checkpoint, the
previous tag is intact, a half-written tag is never loaded, and the next save cleans it up.

One child process imports torch and the library once, then forks one grandchild per crash: each
grandchild saves step1 whole, then starts step2 and dies by SIGKILL either at the k-th fsync or
rename of that save (every durability step, deterministic) or after a random delay (anywhere,
also inside chunk writes). The grandchild must fork before zarr starts its I/O thread, so the
forks come from a process that has not used zarr yet, not from pytest's.
"""

import json
import os

import torch
from children import python_child

from infinity.checkpoint import CheckpointReader, CheckpointWriter, latest_tag

SERVER = r"""
import json, os, random, signal, sys, threading, time
import torch
from infinity.checkpoint import CheckpointWriter

ROOT, RANDOM_KILLS = sys.argv[1], int(sys.argv[2])

def tensors(step):
    g = torch.Generator().manual_seed(step)
    return {f"t{i}": torch.randn(600 + 37 * i, generator=g) for i in range(3)}

def save(directory, step):
    with CheckpointWriter(directory, f"step{step}", metadata={"step": step},
                          chunk_nbytes=1600) as w:
        for name, tensor in tensors(step).items():
            w.add(name, tensor)

def run(directory, kill_at=None, delay_s=None):
    pid = os.fork()
    if pid:
        return os.waitpid(pid, 0)[1]
    try:
        save(directory, 1)
        calls = [0]
        def counted(real):
            def call(*args, **kwargs):
                calls[0] += 1
                if calls[0] == kill_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*args, **kwargs)
            return call
        os.fsync, os.replace, os.rename = map(counted, (os.fsync, os.replace, os.rename))
        if delay_s is not None:
            threading.Timer(delay_s, os.kill, (os.getpid(), signal.SIGKILL)).start()
        start = time.perf_counter()
        save(directory, 2)
        with open(os.path.join(directory, "count.json"), "w") as f:
            json.dump({"calls": calls[0], "seconds": time.perf_counter() - start}, f)
        os._exit(0)
    except BaseException:
        os._exit(3)

assert run(os.path.join(ROOT, "dry")) == 0
dry = json.load(open(os.path.join(ROOT, "dry", "count.json")))
stride = max(1, dry["calls"] // 10)  # about 10 points spread over every phase of the save
plan = [("k", k) for k in range(1, dry["calls"] + 1, stride)] + [("k", dry["calls"])]
rng = random.Random(7)
plan += [("t", rng.uniform(0, 0.7 * dry["seconds"])) for _ in range(RANDOM_KILLS)]
for i, (kind, value) in enumerate(plan):
    status = run(os.path.join(ROOT, f"crash{i}"),
                 **({"kill_at": value} if kind == "k" else {"delay_s": value}))
    print(json.dumps({"dir": f"crash{i}", "kind": kind, "value": value, "status": status}),
          flush=True)
"""


def _expected(step):
    g = torch.Generator().manual_seed(step)
    return {f"t{i}": torch.randn(600 + 37 * i, generator=g) for i in range(3)}


def test_sigkill_during_save_never_leaves_latest_on_an_incomplete_checkpoint(tmp_path):
    out = python_child(["-c", SERVER, str(tmp_path), "5"], timeout=240)
    assert out.returncode == 0, out.stderr
    crashes = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(crashes) > 12, "the save has too few durability steps to test: test broken"
    outcomes = set()
    for crash in crashes:
        directory = tmp_path / crash["dir"]
        killed = os.WIFSIGNALED(crash["status"])
        assert killed or crash["status"] == 0, crash  # exit 3 would be an error inside the save
        tag = latest_tag(directory)
        assert tag in ("step1", "step2"), crash
        outcomes.add((tag, killed))
        reader = CheckpointReader(directory)
        reader.verify()
        step = int(tag.removeprefix("step"))
        assert reader.metadata == {"step": step}
        for name, tensor in _expected(step).items():
            assert torch.equal(reader.read(name), tensor), (crash, name)
        assert torch.equal(CheckpointReader(directory, "step1").read("t0"), _expected(1)["t0"])
        if tag == "step1":  # a run resumed from latest saves step2 again, over any leftover
            with CheckpointWriter(directory, "step2", metadata={"step": 2}) as writer:
                for name, tensor in _expected(2).items():
                    writer.add(name, tensor)
            CheckpointReader(directory).verify()
        with CheckpointWriter(directory, "step3") as writer:  # the next save cleans up
            writer.add("w", torch.ones(2))
        left = sorted(p.name for p in directory.iterdir() if p.name not in ("count.json",))
        assert left == ["latest", "step1", "step2", "step3"], (crash, left)
        assert latest_tag(directory) == "step3"
        assert torch.equal(CheckpointReader(directory, "step2").read("t1"), _expected(2)["t1"])
    assert ("step1", True) in outcomes and ("step2", True) in outcomes, (
        f"crashes should land both before and after step2's commit: {outcomes}")


def test_an_older_tag_that_latest_moved_past_is_never_replaced(tmp_path):
    for tag in ("step1", "step2"):
        with CheckpointWriter(tmp_path, tag) as writer:
            writer.add("w", torch.ones(2))
    try:
        CheckpointWriter(tmp_path, "step1")
    except ValueError as exc:
        assert "exists" in str(exc)
    else:
        raise AssertionError("an existing tag that latest moved past was not refused")
    assert torch.equal(CheckpointReader(tmp_path, "step1").read("w"), torch.ones(2))
