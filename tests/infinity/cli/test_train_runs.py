"""No lost runs: SIGTERM is Ctrl-C (finish the step, save, export, exit 0); one run per
--output (a second is refused naming the first's PID, a dead one's lock is taken over); what a
SIGKILLed run left is cleaned up by the next; an export killed midway leaves no model that
looks complete, and --resume finishes it; --nvme-path inside --output is refused. The runs that
are signalled, killed or hold a lock are the installed infinity-train command in child
processes; the runs that meet what they left run in the test's process (`main`)."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
from safetensors.torch import load_file

from infinity.cli import train

ROOT = str(pathlib.Path(__file__).resolve().parents[3])
SMALL = ("--batch-size", "2", "--seq-len", "32")
ENV = {**os.environ, "PYTHONPATH": ROOT}


def command() -> list[str]:
    installed = shutil.which("infinity-train")
    return [installed] if installed else [sys.executable, "-m", "infinity.cli.train"]


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([*command(), *args], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*command(), *args], env=ENV, capture_output=True, timeout=timeout)


def main(capsys, *args: str) -> subprocess.CompletedProcess:
    """infinity-train in the test's process: (exit code, stdout, stderr) as a child's."""
    capsys.readouterr()
    code = train.main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out.encode(), err.encode())


def first_step(child: subprocess.Popen) -> bytes:
    """Read the child's stderr until its progress bar shows a step."""
    seen = b""
    while b"loss" not in seen:
        chunk = child.stderr.read1(4096)
        if not chunk:
            break
        seen += chunk
    assert b"loss" in seen, seen
    return seen


def finish(child: subprocess.Popen, timeout: float = 600) -> tuple[int, bytes, bytes]:
    try:
        out, err = child.communicate(timeout=timeout)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode, out, err


def one_error_line(err: bytes) -> str:
    lines = err.decode().strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_sigterm_finishes_the_step_saves_and_exports(tmp_path):
    out = tmp_path / "run"
    child = start("--steps", "5000", *SMALL, "--output", str(out), "--nvme-path",
                  str(tmp_path / "nvme"))
    first_step(child)
    child.send_signal(signal.SIGTERM)
    code, stdout, err = finish(child)
    assert code == 0, err
    assert b"stopped early by SIGTERM" in stdout
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert 1 <= steps[-1] < 5000
    assert (out / "checkpoints" / "latest").read_text().strip() == f"step{steps[-1]}"
    assert (out / "model.safetensors.index.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nvme", "run"]  # no staging, no lock
    assert os.listdir(tmp_path / "nvme") == []


def test_a_second_run_on_the_same_output_is_refused_naming_the_first(tmp_path, capsys):
    out = tmp_path / "run"
    first = start("--steps", "5000", *SMALL, "--output", str(out))
    try:
        first_step(first)
        second = main(capsys, "--steps", "1", *SMALL, "--output", str(out))
        assert second.returncode == 2
        assert one_error_line(second.stderr) == (
            f"infinity-train: error: --output {out}: in use by another infinity-train run (PID "
            f"{first.pid}); wait for it or choose another --output")
        resumed = main(capsys, "--steps", "6000", *SMALL, "--output", str(out), "--resume")
        assert resumed.returncode == 2 and f"(PID {first.pid})" in one_error_line(resumed.stderr)
        first.send_signal(signal.SIGTERM)
    finally:
        code, _, err = finish(first)
    assert code == 0, err  # the first run was not disturbed
    assert (out / "model.safetensors.index.json").exists()


def test_what_a_killed_run_left_is_cleaned_up_by_the_next(tmp_path, capsys):
    out, nvme = tmp_path / "run", tmp_path / "nvme"
    child = start("--steps", "5000", *SMALL, "--output", str(out), "--nvme-path", str(nvme))
    first_step(child)
    child.kill()  # SIGKILL: no handler runs
    finish(child)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == [".run.lock", f".run.partial-{child.pid}", "nvme"], left
    assert [p.name.startswith(f"infinity-train-{child.pid}-") for p in nvme.iterdir()] == [True]
    assert (tmp_path / ".run.lock").read_text().strip() == str(child.pid)  # a dead PID's lock
    later = main(capsys, "--steps", "1", *SMALL, "--output", str(out), "--nvme-path", str(nvme))
    assert later.returncode == 0, later.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nvme", "run"]
    assert os.listdir(nvme) == []


def test_a_live_runs_scratch_directory_is_not_taken_for_a_dead_ones(tmp_path, capsys):
    nvme = tmp_path / "nvme"
    first = start("--steps", "5000", *SMALL, "--nvme-path", str(nvme))
    try:
        first_step(first)
        mine = os.listdir(nvme)
        assert main(capsys, "--steps", "1", *SMALL, "--nvme-path", str(nvme)).returncode == 0
        assert os.listdir(nvme) == mine  # still there, still in use
        first.send_signal(signal.SIGTERM)
    finally:
        code, _, err = finish(first)
    assert code == 0, err


KILLED_IN_EXPORT = textwrap.dedent("""
    import os, signal, sys
    from infinity.cli import train
    from infinity.train import export

    real = export.write_shards

    def dies_after_one_shard(directory, specs, tensors, *, max_shard_bytes):
        def stream():
            for i, item in enumerate(tensors):
                yield item
                if i == 3:  # inside the first shard's tensors: the process is killed
                    os.kill(os.getpid(), signal.SIGKILL)
        return real(directory, specs, stream(), max_shard_bytes=max_shard_bytes)

    export.write_shards = dies_after_one_shard
    sys.exit(train.main(sys.argv[1:]))
""")


def test_an_export_killed_midway_is_finished_by_resume(tmp_path, capsys):
    args = ("--steps", "2", *SMALL, "--save-every", "1", "--max-shard-size", "1M")
    whole = main(capsys, *args, "--output", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    out = tmp_path / "run"
    killed = subprocess.run([sys.executable, "-c", KILLED_IN_EXPORT, *args, "--output", str(out)],
                            env=ENV, capture_output=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (out / "checkpoints" / "latest").read_text().strip() == "step2"  # training was done
    assert not list(out.glob("model*"))  # no shard nor index where a loader would look
    again = main(capsys, *args, "--output", str(tmp_path / "run"))
    assert again.returncode == 2 and "add --resume" in one_error_line(again.stderr)
    resumed = main(capsys, *args, "--output", str(out), "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert b"training was done at step 2: only the export ran" in resumed.stdout
    assert not (out / ".export.partial").exists()
    shards = sorted(p.name for p in (tmp_path / "whole").glob("model-*.safetensors"))
    assert len(shards) > 1 and sorted(p.name for p in out.glob("model-*.safetensors")) == shards
    for shard in shards:
        a, b = load_file(out / shard), load_file(tmp_path / "whole" / shard)
        assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)
    done = main(capsys, *args, "--output", str(out), "--resume")  # exported: nothing left
    assert done.returncode == 2 and "--steps 2 leaves nothing to do" in one_error_line(done.stderr)


@pytest.mark.parametrize("where", ["{out}", "{out}/swap"])
def test_nvme_path_inside_output_is_refused_at_start(tmp_path, capsys, where):
    out = tmp_path / "run"
    nvme = where.format(out=out)
    done = main(capsys, "--steps", "1", "--output", str(out), "--nvme-path", nvme)
    assert done.returncode == 2
    assert one_error_line(done.stderr) == (
        f"infinity-train: error: --nvme-path {nvme}: inside --output {out}; put the NVMe files "
        "elsewhere (they are temporary, the output is kept)")
    assert list(tmp_path.iterdir()) == []
