"""Training step of a GPT through the engine against its floor, in the same run.

Configurations, each in a fresh child process (so its peak RSS is its own), alternating in
rounds: "nvme" (the engine, params and optimizer on NVMe under --path), "nvme-clip" (the same
with gradient_clipping --clip: the overlapped step, speculative unless clipping acted at the step
before, docs/engine.md), "nvme-rollback" (clipping that always acts, `infinity.speculate`
"always": every speculated unit rolled back and stepped again),
"nvme-clip-after" (gradient_clipping --clip stepped after backward, overlap_optimizer false: the
step without speculation), "none" (the engine,
offload none), "torch" (plain PyTorch + torch.optim.AdamW(fused=True): PyTorch's fastest AdamW
on the CPU, one pass over the state as the engine's kernel) and, on request, "torch-default"
(AdamW with its default options: on the CPU a loop of several elementwise ops per parameter,
each allocating temporaries). The floor of the nvme step is max(compute: the step with no
offload, NVMe bytes moved per step / the raw aio read+write stream measured in the nvme child on
the same path right after its steps). Each step's wall time and CPU time (all threads of the
child) are recorded: on a shared machine the CPU time varies far less than the wall time. Each
of "nvme" and "nvme-fp32" also has a CPU floor, its own CPU seconds over the cores it may use:
on 2 cores that, not the disk, can be the bound. And where the training thread's step went
besides its CPU: `main_runq_s`, waiting for a core (other threads ran on both), and
`main_sleep_s`, asleep (on I/O, a lock, the GIL, an OpenMP barrier), from
/proc/thread-self/schedstat (null where the kernel has none).
Ratios between configurations are taken within each round, then the median over rounds.

Children run with OMP_WAIT_POLICY=passive by default (--omp-wait-policy): with libgomp's default
policy, torch's intra-op threads spin while they wait, which on a machine with more runnable
threads than cores burns the cores other threads need. libgomp throttles that spinning once a
process runs OpenMP from more than one thread, as the engine does (its optimizer worker), so
without a fixed policy the plain-PyTorch child spins and the engine child does not: measured
2026-12-01 on the shared 2-core machine, plain PyTorch's step (6 blocks) took 2.3-5.4 CPU
seconds spinning and 1.2-1.6 passive, the same math.

"pair" runs the engine with offload none and plain PyTorch in one process, a step of each in
turn (--steps pairs), for the "none over torch" ratio without the spread between processes.

    python -m tools.bench_step --path /nvme                      # ~300M parameters, fp32
    python -m tools.bench_step --path /tmp --configs pair --steps 20 --rounds 2
    python -m tools.bench_step --path /tmp --layers 2 --d-model 64 --vocab 256 --seq 16
    python -m tools.bench_step --path /nvme --bf16 --optimizer-state int8 --no-master
    python -m tools.bench_step --path /nvme --configs nvme,nvme-clip --clip 1.0 --rounds 5
    python -m tools.bench_step --path /nvme --configs nvme,nvme-clip,nvme-rollback,nvme-clip-after \
        --clip 1e9                                      # a rollback's cost

--bf16, --optimizer-state and --no-master set the engine configurations' parameter dtype and
`infinity.optimizer_state` (docs/engine.md "Optimizer state formats"); the torch ones keep
fp32 AdamW. "nvme-fp32" is "nvme" with the default state (fp32 moments and master) whatever
they say: the compressed state's baseline in the same run. Each of "nvme" and "nvme-fp32" is
also reported against its own I/O floor (its bytes / the raw stream of its child), and with
both, the speedup (paired per round) beside the ratio of their bytes per step:

    python -m tools.bench_step --path /nvme --bf16 --optimizer-state int8 --no-master \
        --configs nvme,nvme-fp32 --rounds 3

The engine configs' `infinity.host_memory_budget` is the shipped "auto" (80% of the memory
available), whose rest caches parameters and optimizer state: on a machine with RAM to spare
the model's NVMe traffic is then mostly writes. --host-memory sets a smaller budget for the
NVMe configs (offload off keeps "auto": it holds the model in RAM), so the step moves what a
model far larger than RAM would (the plan refuses one below its least):

    python -m tools.bench_step --path /nvme --bf16 --optimizer-state int8 --no-master \
        --configs nvme,nvme-fp32 --host-memory 1.5GB
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from infinity.cli.args import parse_size
from infinity.memory import peak_rss_bytes, usable_cores

CONFIGS = ("nvme", "nvme-clip", "nvme-rollback", "nvme-clip-after", "nvme-fp32", "none",
           "torch", "torch-default", "pair")
FLOORED = ("nvme", "nvme-fp32")  # configs measured against their own I/O floor
DEFAULT_CONFIGS = ("nvme", "none", "torch")
CLIPPED = ("nvme-clip", "nvme-rollback", "nvme-clip-after")
ALWAYS_ACTS = 1e-9  # the gradient_clipping of "nvme-rollback": below any gradient norm
GB = 1e9


def build(args: argparse.Namespace):
    """The GPT-2 model and one batch of random tokens (seeded)."""
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=args.vocab, n_embd=args.d_model, n_layer=args.layers,
                                  n_head=max(1, args.d_model // 64), n_positions=args.seq,
                                  bos_token_id=0, eos_token_id=0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    return transformers.GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def engine_config(args: argparse.Namespace, config: str, directory: str) -> dict:
    offload = config.split("-")[0]
    device = {"device": offload, **({"nvme_path": directory} if offload == "nvme" else {})}
    clip = {"nvme-clip": args.clip, "nvme-clip-after": args.clip, "nvme-rollback": ALWAYS_ACTS}
    overlap = {"overlap_optimizer": False} if config == "nvme-clip-after" else {}
    if config == "nvme-rollback":  # every step speculated, then rolled back
        overlap = {"speculate": "always"}
    state = {"moments": args.optimizer_state, "master": "none" if args.no_master else "fp32"}
    if config == "nvme-fp32":  # the uncompressed baseline of the same parameters
        state = {"moments": "fp32", "master": "fp32"}
    return {"train_micro_batch_size_per_gpu": args.batch,
            "gradient_clipping": clip.get(config, 0.0),
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": 3, "offload_param": device, "offload_optimizer": device,
                                  "sub_group_size": args.sub_group_size},
            "bf16": {"enabled": args.bf16},
            "infinity": {"optimizer_state": state, **overlap,
                         "host_memory_budget": args.host_memory if offload == "nvme" and
                         args.host_memory is not None else "auto"}}


def _nvme_bytes(stats: dict) -> int:
    return sum(m["nbytes"] for d, m in stats["store"]["moves"].items() if "nvme" in d)


def raw_stream_gbps(directory: str, options: dict, nbytes: int = 32 << 20,
                    count: int = 16) -> float:
    """The raw aio read+write stream (window 2) on `directory`, with the engine's aio options."""
    import aio
    from infinity.cli.nvme_measure import window_stream
    with aio.Handle(**options) as handle, \
            aio.SwapFile(f"{directory}/raw.swap", count * nbytes) as swap:
        extents = [swap.allocate(nbytes) for _ in range(count)]
        fill = aio.aligned_empty(nbytes).fill_(1)
        for e in extents:
            swap.write(handle, e, fill).wait()
        return max(window_stream(handle, swap, extents, nbytes, 2, True) for _ in range(2))


def torch_step(model, batch: dict, *, fused: bool):
    """One plain-PyTorch training step of `model` on `batch` (AdamW, fused or torch's default)."""
    import torch
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)

    def step() -> None:
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def engine_step(engine, batch: dict):
    """One engine training step on `batch`."""
    def step() -> None:
        engine.backward(engine(**batch).loss)
        engine.step()
    return step


def run_child(args: argparse.Namespace, config: str, directory: str) -> dict:
    """Train --steps steps of one configuration in this process; the figures as a dict.

    A step's time runs from its forward to the next step's forward: what training sees, since
    the engine leaves the end of a step's optimizer work and its write-back running into the
    next forward. Timed steps start with nothing left from the untimed ones, and the last one
    also waits for what is left (synchronize, write-back; its seconds are `drain_s`), so it is
    the slowest; the figure is the median over timed steps."""
    model, batch = build(args)
    result: dict = {"config": config, "params": sum(p.numel() for p in model.parameters())}
    marks: list[tuple[float, float]] = []  # at each step's start and after the last: wall, CPU
    counts: list[dict[str, float]] = []  # the engine's counters at the same moments
    if config.startswith("torch"):
        step = torch_step(model, batch, fused=config == "torch")
        for _ in range(args.steps):
            marks.append(_now())
            step()
        marks.append(_now())
    else:
        import infinity
        engine = infinity.initialize(model, engine_config(args, config, directory))

        def mark() -> None:
            marks.append(_now())
            stats = engine.stats()
            room = stats["store"]["room"]
            counts.append({"bytes": _nvme_bytes(stats),
                           "on_demand": stats["prefetch"]["on_demand_nvme"],
                           "compactions": sum(room["compactions"].values()),
                           "compaction_s": sum(room["compaction_s"].values())})

        step = engine_step(engine, batch)
        for i in range(args.steps):
            if i == args.warmup:  # timed steps start with nothing left from untimed ones
                engine.synchronize()
                engine.store.flush()
            mark()
            step()
        drain = time.perf_counter()
        engine.synchronize()
        engine.store.flush()
        result["drain_s"] = time.perf_counter() - drain
        mark()
        result["optimizer"] = engine.stats()["optimizer"]
        if args.trace:
            engine.write_trace(f"{args.trace}.{config}.json")
        options = {**engine.config.aio.handle_options(),
                   "backend": engine.config.infinity.aio_backend}
        engine.close(restore_params=False)
        if config in FLOORED:
            def per_timed_step(key: str) -> float:
                return (counts[-1][key] - counts[args.warmup][key]) / (args.steps - args.warmup)
            result["bytes_per_step"] = per_timed_step("bytes")
            result["on_demand_nvme_after_step_1"] = counts[-1]["on_demand"] - counts[1]["on_demand"]
            # host-tier compactions (each moves the blocks not in use): memmove on the cores
            result["compactions_per_step"] = per_timed_step("compactions")
            result["compaction_s_per_step"] = per_timed_step("compaction_s")
            result["raw_gbps"] = raw_stream_gbps(directory, options)
    pairs = list(zip(marks, marks[1:]))[args.warmup:]
    result["step_s"] = statistics.median(b[0] - a[0] for a, b in pairs)
    result["cpu_s"] = statistics.median(b[1] - a[1] for a, b in pairs)
    result["main_runq_s"] = result["main_sleep_s"] = None
    if all(m[2] is not None for m in marks):
        result["main_runq_s"] = statistics.median(b[3] - a[3] for a, b in pairs)
        result["main_sleep_s"] = statistics.median(  # the clocks read apart: a few ns below 0
            max(0.0, (b[0] - a[0]) - (b[2] - a[2]) - (b[3] - a[3])) for a, b in pairs)
    result["cores"] = usable_cores()
    result["peak_rss"] = peak_rss_bytes()
    return result


SCHEDSTAT = "/proc/thread-self/schedstat"  # the calling thread's ns on a core, ns queued


def _now() -> tuple[float, float, float | None, float | None]:
    """Wall seconds, this process's CPU seconds, and the calling thread's seconds on a core and
    waiting in a run queue for one (None for both without SCHEDSTAT)."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        with open(SCHEDSTAT) as f:
            on_core_ns, queued_ns = f.read().split()[:2]
    except OSError:
        return wall, cpu, None, None
    return wall, cpu, int(on_core_ns) / 1e9, int(queued_ns) / 1e9


def run_pair(args: argparse.Namespace, directory: str) -> dict:
    """"pair": the engine with offload none and plain PyTorch (fused AdamW), two copies of the
    same model in this one process, taking steps in turn (the order swapped every pair), so
    both see the same moment of a shared machine; ratios are taken per pair."""

    import infinity
    model, batch = build(args)
    params = sum(p.numel() for p in model.parameters())
    engine = infinity.initialize(model, engine_config(args, "none", directory))
    twin, _ = build(args)
    times: dict[str, list[tuple[float, float]]] = {"none": [], "torch": []}
    order = [("torch", torch_step(twin, batch, fused=True)), ("none", engine_step(engine, batch))]
    for i in range(args.steps):
        for name, step in order if i % 2 == 0 else order[::-1]:
            start, cpu = time.perf_counter(), time.process_time()
            step()
            if i >= args.warmup:
                times[name].append((time.perf_counter() - start, time.process_time() - cpu))
    engine.close(restore_params=False)
    ratios = [e[0] / t[0] for e, t in zip(times["none"], times["torch"])]
    cpu_ratios = [e[1] / t[1] for e, t in zip(times["none"], times["torch"])]
    return {"config": "pair", "params": params,
            "none_step_s": statistics.median(e[0] for e in times["none"]),
            "torch_step_s": statistics.median(t[0] for t in times["torch"]),
            "ratio": statistics.median(ratios), "cpu_ratio": statistics.median(cpu_ratios),
            "ratio_range": f"{min(ratios):.3g}-{max(ratios):.3g}", "peak_rss": peak_rss_bytes()}


def report(runs: dict[str, list[dict]]) -> dict:
    """Medians and ranges per configuration, the floor and the ratios."""
    def med(config: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[config])

    def rng(config: str, key: str) -> str:
        values = [r[key] for r in runs[config]]
        return f"{min(values):.3g}-{max(values):.3g}"

    def med_or_none(config: str, key: str) -> float | None:
        values = [r[key] for r in runs[config]]
        return None if None in values else statistics.median(values)

    out = {c: {"step_s": med(c, "step_s"), "step_range": rng(c, "step_s"), "cpu_s": med(c, "cpu_s"),
               "cpu_range": rng(c, "cpu_s"), "main_runq_s": med_or_none(c, "main_runq_s"),
               "main_sleep_s": med_or_none(c, "main_sleep_s"),
               "peak_rss_gb": med(c, "peak_rss") / GB}
           for c in runs if c != "pair"}
    if "pair" in runs:
        out["none over torch, interleaved"] = {
            "ratio": med("pair", "ratio"), "cpu_ratio": med("pair", "cpu_ratio"),
            "none_step_s": med("pair", "none_step_s"), "torch_step_s": med("pair", "torch_step_s"),
            "pair_ratio_range": ",".join(r["ratio_range"] for r in runs["pair"])}
    for config in (c for c in FLOORED if c in runs):
        nvme = out[config]
        nvme.update(bytes_per_step_gb=med(config, "bytes_per_step") / GB,
                    raw_gbps=med(config, "raw_gbps"),
                    on_demand_nvme_after_step_1=max(r["on_demand_nvme_after_step_1"]
                                                    for r in runs[config]),
                    compactions_per_step=med(config, "compactions_per_step"),
                    compaction_s_per_step=med(config, "compaction_s_per_step"))
        io_s = nvme["bytes_per_step_gb"] / nvme["raw_gbps"]
        out[f"{config} over its I/O floor"] = {"io_s": io_s, "ratio": nvme["step_s"] / io_s}
        cpu_floor_s = nvme["cpu_s"] / med(config, "cores")
        own = max(io_s, cpu_floor_s)
        out[f"{config} over its own floor"] = {
            "floor_s": own, "bound": "I/O" if io_s >= cpu_floor_s else "CPU",
            "cpu_floor_s": cpu_floor_s, "ratio": nvme["step_s"] / own}
        for base in ("none", "torch"):
            if base in out:
                floor = max(out[base]["step_s"], io_s)
                out[f"{config} over floor ({base} compute)"] = {"floor_s": floor, "io_s": io_s,
                                                               "ratio": nvme["step_s"] / floor}
    if "nvme" in runs and "nvme-fp32" in runs:
        speedup, speedup_range = paired_ratio(runs["nvme-fp32"], runs["nvme"], "step_s")
        out["nvme-fp32 over nvme"] = {
            "speedup": speedup, "range": speedup_range,
            "byte_ratio": out["nvme-fp32"]["bytes_per_step_gb"] / out["nvme"]["bytes_per_step_gb"]}
    for clipped in (c for c in CLIPPED if c in runs and "nvme" in runs):
        step, step_range = paired_ratio(runs[clipped], runs["nvme"], "step_s")
        cpu, cpu_range = paired_ratio(runs[clipped], runs["nvme"], "cpu_s")
        out[f"{clipped} over nvme"] = {
            "ratio": step, "range": step_range, "cpu_ratio": cpu, "cpu_range": cpu_range,
            "rollbacks": [r["optimizer"]["rollbacks"] for r in runs[clipped]],
            "units_speculated": [r["optimizer"]["units_speculated"] for r in runs[clipped]],
            "steps_not_speculated": [r["optimizer"]["steps_not_speculated"]
                                     for r in runs[clipped]]}
    for base in ("torch", "torch-default"):
        if "none" in out and base in out:
            step, step_range = paired_ratio(runs["none"], runs[base], "step_s")
            cpu, cpu_range = paired_ratio(runs["none"], runs[base], "cpu_s")
            out[f"none over {base}"] = {"ratio": step, "range": step_range, "cpu_ratio": cpu,
                                        "cpu_range": cpu_range}
    return out


def paired_ratio(runs: list[dict], bases: list[dict], key: str) -> tuple[float, str]:
    """Median and range over rounds of runs[r][key] / bases[r][key]: each ratio compares two
    children of one round, run one after the other (the machine's load drifts over minutes)."""
    ratios = [a[key] / b[key] for a, b in zip(runs, bases, strict=True)]
    return statistics.median(ratios), f"{min(ratios):.3g}-{max(ratios):.3g}"


def child_env(args: argparse.Namespace) -> dict[str, str]:
    """The children's environment: this one, with the OpenMP wait policy asked for."""
    env = dict(os.environ)
    if args.omp_wait_policy != "inherit":
        env["OMP_WAIT_POLICY"] = args.omp_wait_policy
    return env


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--path", required=True, help="directory on the NVMe disk (nvme_path)")
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=5, help="steps per child")
    parser.add_argument("--warmup", type=int, default=2,
                        help="steps not timed (the engine records its trace in step 1; torch and "
                             "the allocator touch their memory for the first time in steps 1-2)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of all configs, alternating")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                        help="subset of " + ",".join(CONFIGS))
    parser.add_argument("--clip", type=float, default=1.0,
                        help="gradient_clipping of the nvme-clip configuration")
    parser.add_argument("--sub-group-size", type=int, default=2_000_000,
                        help="elements per optimizer tile (sub_group_size)")
    parser.add_argument("--bf16", action="store_true", help="engine configs: bf16 parameters")
    parser.add_argument("--optimizer-state", choices=("fp32", "bf16", "int8"), default="fp32",
                        help="engine configs: infinity.optimizer_state.moments")
    parser.add_argument("--no-master", action="store_true",
                        help="engine configs: no fp32 master (needs --bf16)")
    parser.add_argument("--host-memory", type=parse_size,
                        help="nvme configs: infinity.host_memory_budget (bytes or '1.5GB'; "
                             "default: the shipped \"auto\")")
    parser.add_argument("--omp-wait-policy", choices=("passive", "active", "inherit"),
                        default="passive",
                        help="OMP_WAIT_POLICY of the children "
                             "('inherit': this process's environment)")
    parser.add_argument("--trace",
                        help="write each engine child's Perfetto trace to TRACE.<config>.json")
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument("--child", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not set(args.configs.split(",")) <= set(CONFIGS) or not 1 <= args.warmup < args.steps:
        parser.error(f"--configs takes {','.join(CONFIGS)}; --warmup at least 1 and below --steps")
    if args.no_master and not args.bf16:
        parser.error("--no-master needs --bf16 (fp32 parameters are their own master)")
    return args


def scratch_directory(path: str, prefix: str) -> str | None:
    """A fresh directory under --path for a run's files; None, the reason said on stderr in one
    line, where the path cannot hold one."""
    try:
        return tempfile.mkdtemp(prefix=prefix, dir=path)
    except OSError as exc:
        print(f"error: cannot use --path {path}: {exc.strerror}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    configs = args.configs.split(",")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.child:
        run = run_pair if args.child == "pair" else lambda a, path: run_child(a, args.child, path)
        print(json.dumps(run(args, args.path)))
        return 0
    directory = scratch_directory(args.path, "infinity-bench-step-")
    if directory is None:
        return 2
    runs: dict[str, list[dict]] = {c: [] for c in configs}
    try:
        for r in range(args.rounds):
            for config in configs if r % 2 == 0 else configs[::-1]:
                done = subprocess.run([sys.executable, "-m", "tools.bench_step", *argv,
                                       "--path", directory, "--child", config],
                                      capture_output=True, text=True, env=child_env(args))
                if done.returncode != 0:
                    print(f"error: {config} child failed:\n{done.stderr[-4000:]}", file=sys.stderr)
                    return 1
                runs[config].append(json.loads(done.stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    results = report(runs)
    print(f"params={runs[configs[0]][0]['params']}  rounds={args.rounds}  steps/child={args.steps}")
    for label, r in results.items():
        print(f"{label:>30}: " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "runs": runs}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
