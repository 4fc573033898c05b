"""infinity-train checkpoints: --save-every + --resume continues bit-identically (same losses,
same exported weights as one uninterrupted run), Ctrl-C saves a checkpoint that --resume
continues, and the checkpoint options' bad input gives one line and exit 2."""

import json
import os
import signal
import subprocess
import sys
import time

import torch
from safetensors.torch import load_file

from infinity.checkpoint import CheckpointWriter
from tools import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = ("--steps", "4", "--batch-size", "2", "--seq-len", "32")


def run_main(capsys, *args):
    code = train.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def losses(out_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())}


def weights(out_dir):
    return load_file(out_dir / "model-00001-of-00001.safetensors")


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert wa[name].dtype == wb[name].dtype and wa[name].equal(wb[name]), name


def test_save_every_and_resume_equals_one_run(tmp_path, capsys):
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    assert run_main(capsys, *SMALL, "--output", str(whole))[0] == 0
    code, out, err = run_main(capsys, *SMALL[:1], "2", *SMALL[2:], "--save-every", "1", "--output", str(halves))
    assert code == 0, err
    assert sorted(os.listdir(halves / "checkpoints")) == ["latest", "step1", "step2"]
    # a job that died after step 3 without a checkpoint left a line the resumed run redoes
    with open(halves / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "loss": 0.0}) + "\n")
    code, out, err = run_main(capsys, *SMALL, "--save-every", "3", "--output", str(halves), "--resume")
    assert code == 0, err
    assert losses(halves) == losses(whole)  # exactly: the second half took the same batches
    assert list(losses(halves)) == [1, 2, 3, 4]
    assert_same_weights(halves, whole)
    assert sorted(os.listdir(halves / "checkpoints")) == ["latest", "step1", "step2", "step3"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_sigint_saves_a_checkpoint_that_resume_continues(tmp_path, capsys):
    out_dir = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-m", "tools.train", "--steps", "2000", "--batch-size", "2",
                              "--seq-len", "32", "--output", str(out_dir)],
                             cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        seen = b""
        deadline = time.monotonic() + 60
        while b"loss" not in seen and time.monotonic() < deadline:
            chunk = child.stderr.read1(4096)
            if not chunk:
                break
            seen += chunk
        assert b"loss" in seen, seen
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    stopped = len(losses(out_dir))
    assert 1 <= stopped < 2000
    assert (out_dir / "checkpoints" / "latest").read_text().strip() == f"step{stopped}"
    code, out, err = run_main(capsys, "--steps", str(stopped + 2), "--batch-size", "2", "--seq-len", "32",
                              "--output", str(out_dir), "--resume")
    assert code == 0, err
    assert list(losses(out_dir)) == list(range(1, stopped + 3))


def test_checkpoint_options_bad_input(tmp_path, capsys):
    cases = [
        ((*SMALL, "--save-every", "2"), "--save-every needs --output"),
        ((*SMALL, "--resume"), "--resume needs --output"),
        ((*SMALL, "--resume", "--output", str(tmp_path / "none")),
         f"--resume: no checkpoint in {tmp_path / 'none' / 'checkpoints'}"),
    ]
    for args, message in cases:
        code, out, err = run_main(capsys, *args)
        assert code == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"infinity-train: error: {message}"), err
    assert os.listdir(tmp_path) == []
    run_dir = tmp_path / "run"
    assert run_main(capsys, "--steps", "1", "--batch-size", "2", "--seq-len", "32", "--save-every", "1",
                    "--output", str(run_dir))[0] == 0
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    for args, message in [
        (("--steps", "1", "--resume"), "--resume: the checkpoint is at step 1, --steps 1"),
        (("--steps", "3", "--resume", "--batch-size", "3"),
         "--resume: the checkpoint at step 1 was made with batch_size 2, this run has 3"),
        (("--steps", "3"), f"--output {run_dir}: exists and is not an empty directory (it holds checkpoints: "
                           "add --resume"),
    ]:
        code, out, err = run_main(capsys, "--batch-size", "2", "--seq-len", "32", *args, "--output", str(run_dir))
        assert code == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"infinity-train: error: {message}"), err
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before  # untouched
    foreign = tmp_path / "foreign"
    with CheckpointWriter(foreign / "checkpoints", "step1", metadata={}) as writer:
        writer.add("w", torch.zeros(2))
    code, out, err = run_main(capsys, *SMALL, "--output", str(foreign), "--resume")
    assert code == 2 and err.strip() == (f"infinity-train: error: --resume: checkpoint {foreign}/checkpoints/step1 "
                                         "was not written by infinity-train (no step and data position in its "
                                         "client_state)"), err
