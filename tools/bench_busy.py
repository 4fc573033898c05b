"""Training on a busy machine against the same training quiet, and against plain PyTorch under
the same load (issue 19).

Each round runs every workload twice, once on the quiet machine and once beside `--busy`
processes that spin on a core each (`python3 -c 'while True: pass'`, one per core by default),
quiet first in odd rounds and busy first in even ones, so drift in the machine's own load hits
both. Workloads:

- `default`: the default run, `python -m infinity.cli.train --steps N` (the built-in model and
  corpus, parameters and Adam state on NVMe), against `default-torch`: the same model, batch
  shape and AdamW in a plain PyTorch loop, nothing offloaded.
- `step`: the 294 M GPT's NVMe step through `tools.bench_step --configs nvme,torch` (one round
  of its engine child and its plain PyTorch child).

Reported per workload: the median step quiet and busy, busy / quiet (issue 19's goal: at most
2.5x), and the engine's step / plain PyTorch's in each condition.

    python -m tools.bench_busy --path /tmp --workloads default,step --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKLOADS = ("default", "step")

# The default run's model, batch and optimizer in a plain PyTorch loop: what the engine's
# default run is measured against on the same machine under the same load.
_DEFAULT_TORCH = r"""
import json, sys, time
import torch
from infinity.train.config import DEFAULT_BATCH_SIZE as batch
from infinity.train.job import TrainOptions
from infinity.train.models import default_model
steps, seq_len = int(sys.argv[1]), TrainOptions().seq_len
model, _ = default_model(seed=0)
vocab = model.config.vocab_size
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
generator = torch.Generator().manual_seed(0)
times = []
for _ in range(steps):
    ids = torch.randint(0, vocab, (batch, seq_len), generator=generator)
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    times.append(time.perf_counter() - t0)
print(json.dumps({"step_s": times}))
"""


@contextlib.contextmanager
def busy(processes: int) -> Iterator[None]:
    """`processes` Python loops that each keep one core busy while the block runs."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(processes)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def _run(args: list[str], *, cwd: pathlib.Path) -> str:
    done = subprocess.run([sys.executable, *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def _median_after_first(times: list[float]) -> float:
    return statistics.median(times[1:] or times)  # the first step also records the traces


def default_round(scratch: pathlib.Path, steps: int) -> dict[str, float]:
    """One default run through the engine and one in plain PyTorch: their median steps."""
    from infinity.train.report import read_history  # torch loads only where a round runs

    out = pathlib.Path(tempfile.mkdtemp(prefix="run-", dir=scratch))
    try:
        _run(["-m", "infinity.cli.train", "--steps", str(steps), "--output", str(out / "run"),
              "--nvme-path", str(out / "nvme")], cwd=scratch)
        engine = [r["step_s"] for r in read_history(out / "run" / "metrics.jsonl")]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    torch = json.loads(_run(["-c", _DEFAULT_TORCH, str(steps)], cwd=scratch).splitlines()[-1])
    torch = torch["step_s"]
    return {"default": _median_after_first(engine), "default-torch": _median_after_first(torch)}


def step_round(scratch: pathlib.Path, steps: int) -> dict[str, float]:
    """One engine child and one plain PyTorch child of tools.bench_step (the 294 M GPT)."""
    figures = scratch / "step.json"
    _run(["-m", "tools.bench_step", "--path", str(scratch), "--configs", "nvme,torch",
          "--steps", str(steps), "--json", str(figures)], cwd=ROOT)
    runs = json.loads(figures.read_text())["runs"]
    return {"step-nvme": runs["nvme"][0]["step_s"], "step-torch": runs["torch"][0]["step_s"]}


def report(quiet: dict[str, list[float]], loaded: dict[str, list[float]]) -> dict[str, dict]:
    out = {}
    for name in quiet:
        q, b = statistics.median(quiet[name]), statistics.median(loaded[name])
        out[name] = {"quiet_s": q, "busy_s": b, "busy_over_quiet": b / q,
                     "rounds": [round(x / y, 2) for x, y in zip(loaded[name], quiet[name])]}
    for engine, torch in (("default", "default-torch"), ("step-nvme", "step-torch")):
        if engine in out:
            out[engine]["over_torch_quiet"] = out[engine]["quiet_s"] / out[torch]["quiet_s"]
            out[engine]["over_torch_busy"] = out[engine]["busy_s"] / out[torch]["busy_s"]
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--path", required=True, help="directory for NVMe files and runs")
    parser.add_argument("--workloads", default="default,step",
                        help=f"subset of {','.join(WORKLOADS)}")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, quiet and busy each")
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1,
                        help="spinning processes in the busy half (default: one per core)")
    parser.add_argument("--default-steps", type=int, default=30, help="steps of a default run")
    parser.add_argument("--step-steps", type=int, default=5, help="steps of a bench_step child")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    workloads = args.workloads.split(",")
    if not set(workloads) <= set(WORKLOADS) or args.rounds < 1 or args.busy < 1:
        parser.error(f"--workloads takes {','.join(WORKLOADS)}; --rounds and --busy at least 1")
    args.workloads = workloads
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        scratch = pathlib.Path(tempfile.mkdtemp(prefix="infinity-bench-busy-", dir=args.path))
    except OSError as exc:
        print(f"error: cannot use --path {args.path}: {exc.strerror}", file=sys.stderr)
        return 2
    rounds = {"default": lambda: default_round(scratch, args.default_steps),
              "step": lambda: step_round(scratch, args.step_steps)}
    quiet: dict[str, list[float]] = {}
    loaded: dict[str, list[float]] = {}
    try:
        for r in range(args.rounds):
            for spinning in ((False, True) if r % 2 == 0 else (True, False)):
                into = loaded if spinning else quiet
                with busy(args.busy) if spinning else contextlib.nullcontext():
                    for workload in args.workloads:
                        for name, seconds in rounds[workload]().items():
                            into.setdefault(name, []).append(seconds)
                print(f"round {r + 1} {'busy' if spinning else 'quiet'}: "
                      f"{os.getloadavg()[0]:.1f} load", file=sys.stderr)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results = report(quiet, loaded)
    print(f"rounds={args.rounds}  busy processes={args.busy}  cores={os.cpu_count()}")
    for name, r in results.items():
        print(f"{name:>14}: " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                          for k, v in r.items()))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
