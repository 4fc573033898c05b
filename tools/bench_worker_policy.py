"""The optimizer worker's scheduling policy, alternated step by step inside one engine child.

On 2 cores the worker that steps units during backward preempts one of torch's two OpenMP
threads inside its parallel regions, and the other waits at the region's end (docs/performance.md
"Backward beside the optimizer's worker"). Whether a policy for the worker thread gives that
back is a few percent of a step, while whole-run A/B pairs on a shared host swing by +-20% with
the host's speed. So this builds bench_step's "nvme" engine and model once and sets the worker
thread to the trial policy or to SCHED_OTHER in blocks of --block steps, the blocks in ABBA order
after the warm-up steps: both sides see the same minutes. Each step is timed from its forward to
the next step's forward, as bench_step times it, but for the first step of each block: it
carries what the block before left running (the step's tail runs into the next forward), which
would be charged to the other side. Step by step (--block 1) is fair only for a change that
moves no work from one step to the next: leaving units to the next forward measured 0.86-0.96
of the step that way and 1.15x in blocks of 4 (docs/performance.md). Linux only.

`--policy torch-1` instead gives torch one intra-op thread in the trial steps (the default
count in the others): the training thread computes alone while the worker has the other core.

SCHED_IDLE is for measuring, not for training: an idle-class worker is starved by any other
process's load, also while it holds the GIL the training thread needs (one step of 259 s beside
two busy processes, the same page), and leaving SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE
of 20.

    python -m tools.bench_worker_policy --policy idle --path /nvme --bf16 \
        --optimizer-state int8 --no-master --steps 34          # 8 blocks of 4 after 2 warm-up

Every option after --policy and --block is bench_step's (the model, the engine configuration,
--steps, by default 8 blocks after the warm-up, --warmup); --rounds, --configs and --trace are
not used.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import threading
import time

import torch

from tools import bench_step

POLICIES = {"idle": "SCHED_IDLE", "batch": "SCHED_BATCH", "other": "SCHED_OTHER"}
ONE_TORCH_THREAD = "torch-1"
NAMES = {**POLICIES, ONE_TORCH_THREAD: "1 torch thread"}


def set_policy(tid: int, name: str) -> None:
    """Put thread `tid` under `name` (an os.SCHED_* name), and check that it took."""
    policy = getattr(os, name)
    try:
        os.sched_setscheduler(tid, policy, os.sched_param(0))
    except PermissionError:
        raise SystemExit(f"error: cannot put the worker thread under {name}: leaving SCHED_IDLE "
                         "needs CAP_SYS_NICE or an RLIMIT_NICE of 20") from None
    if os.sched_getscheduler(tid) != policy:
        raise SystemExit(f"error: the worker thread is not under {name} after setting it")


def _optimizer_workers() -> set[int]:
    """The native ids of this process's optimizer worker threads (named infinity-optim)."""
    return {t.native_id for t in threading.enumerate() if t.name.startswith("infinity-optim")}


def run(args: argparse.Namespace, trial: str, directory: str,
        blocks: int = 4) -> dict[str, list[float]]:
    """Step the engine, the sides alternating in `blocks` steps; the timed steps' wall seconds
    under each policy."""
    import infinity
    model, batch = bench_step.build(args)
    engine = infinity.initialize(model, bench_step.engine_config(args, "nvme", directory))
    try:
        step = bench_step.engine_step(engine, batch)
        before = _optimizer_workers()  # other engines' in this process (a test's) are not ours
        step()  # the optimizer's worker starts with the first step
        started = _optimizer_workers() - before
        if len(started) != 1:
            raise SystemExit(f"error: the first step started {len(started)} optimizer worker "
                             "threads, not one")
        worker = started.pop()
        torch_threads = torch.get_num_threads()

        def apply(side: str) -> None:
            if trial == ONE_TORCH_THREAD:
                torch.set_num_threads(1 if side == trial else torch_threads)
            else:
                set_policy(worker, POLICIES[side])
        times: dict[str, list[float]] = {trial: [], "other": []}
        try:
            for i in range(1, args.steps):
                if i == args.warmup:  # timed steps start with nothing left from untimed ones
                    engine.synchronize()
                    engine.store.flush()
                block, at = divmod(i - args.warmup, blocks)
                side = trial if block % 4 in (1, 2) else "other"  # blocks in ABBA order
                apply(side)
                start = time.perf_counter()
                step()
                if i >= args.warmup and (at > 0 or blocks == 1):  # not what a block inherits
                    times[side].append(time.perf_counter() - start)
        finally:
            apply("other")
        engine.synchronize()
    finally:
        engine.close(restore_params=False)
    return times


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", choices=("idle", "batch", ONE_TORCH_THREAD), required=True,
                        help="the worker's policy tried against SCHED_OTHER, or torch-1: one "
                             "torch thread against the default count")
    parser.add_argument("--block", type=int, default=4,
                        help="steps per block of one side; the first of each is not timed")
    ours, rest = parser.parse_known_args(argv)
    if ours.block < 1:
        parser.error("--block takes a step count >= 1")
    args = bench_step.parse_args(rest)
    if not any(a == "--steps" or a.startswith("--steps=") for a in rest):
        args.steps = args.warmup + 8 * ours.block  # 8 blocks after the warm-up
    least = ours.block + 1 + (ours.block > 1)  # the trial side's first timed step is the last
    if args.steps - args.warmup < least:
        parser.error(f"--steps {args.steps} after --warmup {args.warmup} times no step of the "
                     f"trial side in blocks of {ours.block}: at least {least} after the warm-up")
    if sys.platform != "linux":
        parser.error("scheduling policies per thread are Linux's")
    directory = bench_step.scratch_directory(args.path, "infinity-bench-policy-")
    if directory is None:
        return 2
    try:
        times = run(args, ours.policy, directory, ours.block)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    trial, other = times[ours.policy], times["other"]
    wins = sum(t < o for t, o in zip(trial, other))
    base = "SCHED_OTHER" if ours.policy in POLICIES else f"{torch.get_num_threads()} torch threads"
    for name, ts in ((NAMES[ours.policy], trial), (base, other)):
        print(f"{name:>15}: steps={len(ts)}  median_s={statistics.median(ts):.3f}  "
              f"mean_s={statistics.mean(ts):.3f}  range={min(ts):.2f}-{max(ts):.2f}")
    print(f"{NAMES[ours.policy]} over {base}: median ratio="
          f"{statistics.median(trial) / statistics.median(other):.3f}  faster in {wins} of "
          f"{min(len(trial), len(other))} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
