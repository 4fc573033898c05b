"""infinity-nvme-bench: how fast the aio engine moves bytes between memory and a disk, next to fio.

    infinity-nvme-bench --path /tmp --size 2G --fio --repeat 4   # write, read, 4 KiB cost; vs fio
    infinity-nvme-bench --path /tmp --size 1G --sweep --json sweep.json   # best `aio` config block
    infinity-nvme-bench --path /tmp --size 2G --mix --repeat 8  # layer fetch/optimizer vs DeepSpeed
    infinity-nvme-bench --path /mnt/nvme --read --block-size 4M --queue-depth 16 --threads 2
    infinity-nvme-bench --path /dev/shm --size 256M --fio          # tmpfs: software cost only

GB/s are decimal (1e9 bytes/s). Reads come from the disk, never the page cache (O_DIRECT, and
the file is evicted before each read); writes overwrite a file written once beforehand. Every
file lives in a fresh directory under --path, removed at the end, also on errors and Ctrl-C.
Without an install: `python -m infinity.cli.nvme_bench ...` from the repository root.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any

from tqdm import tqdm

import aio
from aio import device_pauses
from infinity.cli import layer_io
from infinity.cli import nvme_measure as bench
from infinity.cli.args import HelpFormatter, log_to_stderr, parse_size

PROG = "infinity-nvme-bench"
SWEEP = {"block_size": [256 << 10, 1 << 20, 4 << 20], "queue_depth": [4, 16, 64], "threads": [1, 2]}
MIX_PASSES = 2


def _listed(convert):
    def parse(text: str) -> list:
        return [convert(item) for item in text.split(",") if item.strip()]
    parse.__name__ = convert.__name__  # argparse names the type in its error messages
    return parse


class _Given(argparse.Action):
    """Store the value and remember the option was given (--sweep fills in the others)."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = (*namespace.given, self.dest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    p.set_defaults(given=())
    p.add_argument("--path", required=True, help="directory on the disk to measure (a temporary "
                   "directory is made inside it and removed at the end)")
    p.add_argument("--size", type=parse_size, default="2G", help="bytes of the test file (K/M/G)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--read", action="store_true", help="sequential reads only (without "
                      "--read, --write or --mix: sequential write, then read)")
    mode.add_argument("--write", action="store_true", help="sequential writes only")
    mode.add_argument("--mix", action="store_true", help="training-like replay: layer tensors "
                      "read ahead while others are written back, one aio.SwapFile")
    p.add_argument("--block-size", type=_listed(parse_size), default="1M", action=_Given,
                   help="bytes per piece (fio's bs); a comma list is swept (--sweep: 256K,1M,4M)")
    p.add_argument("--queue-depth", type=_listed(int), default="32", action=_Given,
                   help="pieces in flight per queue; comma list (--sweep: 4,16,64)")
    p.add_argument("--threads", type=_listed(int), default="1", action=_Given,
                   help="queues, i.e. DeepSpeed intra_op_parallelism; comma list (--sweep: 1,2)")
    p.add_argument("--backend", type=_listed(str), default="auto", action=_Given,
                   help=f"engine: auto or a comma list of {aio.available_backends()} "
                        "(--sweep: all of them)")
    p.add_argument("--sweep", action="store_true",
                   help="try every combination of the four options above (the sweep grid for "
                        "those not given); print a table and the best `aio` block")
    p.add_argument("--fio", action="store_true",
                   help="also run fio (ioengines io_uring and libaio, direct=1) with bs=block "
                        "size, iodepth=queue depth, numjobs=threads; print ours/fio")
    p.add_argument("--small-requests", type=int, default=20000, help="4 KiB random reads for the "
                   "per-request cost, queue_depth * threads in flight (0: skip)")
    p.add_argument("--repeat", type=int, default=1, help="measure each figure this many times, "
                   "interleaved with fio; report median [min-max]")
    p.add_argument("--json", metavar="FILE", help="also write every result to FILE as JSON")
    p.add_argument("--verbose", action="store_true", help="log the library's decisions (INFO)")
    return p


def _check_path(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not os.path.isdir(args.path):
        parser.error(f"--path {args.path}: no such directory")
    if not os.access(args.path, os.W_OK | os.X_OK):
        parser.error(f"--path {args.path}: not writable by this user")
    if args.size % 4096 or args.repeat < 1 or args.small_requests < 0:
        parser.error("--size must be a multiple of 4 KiB, --repeat >= 1, --small-requests >= 0")
    if args.json:  # checked now, not after the whole benchmark
        target = os.path.abspath(args.json)
        folder = os.path.dirname(target)
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
            parser.error(f"--json {args.json}: {folder} is no writable directory")
        if os.path.isdir(target) or (os.path.exists(target) and not os.access(target, os.W_OK)):
            parser.error(f"--json {args.json}: is a directory or not writable")
    free = shutil.disk_usage(args.path).free
    if args.size + (64 << 20) > free:
        parser.error(f"--size {_human(args.size)} does not fit: {args.path} has "
                     f"{_human(free)} free (and 64 MiB are kept spare); pass a smaller --size")


def _grid(args: argparse.Namespace) -> list[bench.EngineConfig]:
    lists = {}
    for name in ("block_size", "queue_depth", "threads", "backend"):
        value = getattr(args, name)
        if args.sweep and name not in args.given:
            value = aio.available_backends() if name == "backend" else SWEEP[name]
        lists[name] = value
    return [bench.EngineConfig(*combo) for combo in itertools.product(
        lists["block_size"], lists["queue_depth"], lists["threads"], lists["backend"])]


def _human(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 1 << 30 else f"{nbytes / 2**20:.0f} MiB"


def _fmt(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    med, low, high = (v * scale for v in bench.summarize(values))
    return (f"{med:.{digits}f}" if len(values) == 1
            else f"{med:.{digits}f} [{low:.{digits}f}-{high:.{digits}f}]")


def _sweep(args, configs, data, ops) -> tuple[bench.EngineConfig, list[dict]]:
    rows, scored = [], []
    print(f"{'backend':9}{'block':>7}{'qd':>4}{'thr':>4}" + "".join(
        f"{op + ' GB/s':>13}{'p50 ms':>8}{'p99 ms':>8}" for op in ops))
    for config in tqdm(configs, desc="sweep", unit="config", disable=None):
        with config.open() as handle:
            config = dataclasses.replace(config, backend=handle.backend)
            runs = {op: [] for op in ops}
            for _, op in itertools.product(range(args.repeat), ops):
                if op == "read":
                    bench.drop_page_cache(data)
                runs[op].append(bench.sequential(handle, data, args.size, op))
        line = (f"{config.backend:9}{config.block_size >> 10:>6}K"
                f"{config.queue_depth:>4}{config.threads:>4}")
        for op in ops:
            med = {k: bench.summarize(getattr(r, k) for r in runs[op]).median
                   for k in ("gbps", "p50_s", "p99_s")}
            line += f"{med['gbps']:>13.2f}{med['p50_s'] * 1e3:>8.1f}{med['p99_s'] * 1e3:>8.1f}"
        tqdm.write(line)
        seconds = sum(bench.summarize(r.seconds for r in runs[op]).median for op in ops)
        scored.append((config, len(ops) * args.size / seconds))
        rows.append({"config": dataclasses.asdict(config),
                     **{op: [r.as_dict() for r in runs[op]] for op in ops}})
    best = bench.pick_best(scored)
    print(f"best: highest {'/'.join(ops)} GB/s, or among configs within 5% of it (noise) "
          "the one with the least memory at the device:")
    print(json.dumps(best.aio_section(), indent=2))
    return best, rows


def _table(header: list[str], rows: list[list[str]]) -> None:
    """Print columns sized to fit: the first two left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  " + "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w)
                               for i, (cell, w) in enumerate(zip(row, widths, strict=True))))


def _measure(args, config, data, ops, fio: str | None):
    """Ours (and fio) at one config. The repeats are interleaved and the order of the tools
    alternates from round to round, so the drift of a shared disk hits both alike."""
    seq: dict[str, dict[str, list[bench.Throughput]]] = {op: {} for op in ops}
    small: dict[str, list[bench.Throughput]] = {}
    small_config = dataclasses.replace(config, block_size=bench.SMALL_NBYTES)
    with config.open() as handle:
        config = dataclasses.replace(config, backend=handle.backend)
        engines = [e for e in bench.FIO_ENGINES if fio and e in aio.available_backends()]
        tools = [f"aio/{config.backend}", *(f"fio/{e}" for e in engines)]
        for round_ in tqdm(range(args.repeat), desc="measure", unit="round", disable=None):
            order = tools if round_ % 2 == 0 else tools[::-1]
            for op, tool in itertools.product(ops, order):
                if op == "read":
                    bench.drop_page_cache(data)
                seq[op].setdefault(tool, []).append(
                    bench.sequential(handle, data, args.size, op) if tool.startswith("aio/") else
                    bench.run_fio(fio, data, op, args.size, config, tool.removeprefix("fio/")))
            for tool in order if args.small_requests else ():
                small.setdefault(tool, []).append(
                    bench.small_reads(handle, data, args.small_requests)
                    if tool.startswith("aio/") else
                    bench.run_fio(fio, data, "randread", args.size, small_config,
                                  tool.removeprefix("fio/"), requests=args.small_requests))
    return (config, {op: dict(sorted(by_tool.items())) for op, by_tool in seq.items()},
            dict(sorted(small.items())))


def _report(args, config, data, ops, fio: str | None) -> dict[str, Any]:
    config, seq, small = _measure(args, config, data, ops, fio)
    ours = f"aio/{config.backend}"
    median = lambda runs, key: bench.summarize(getattr(r, key) for r in runs).median  # noqa: E731
    request_nbytes = next(iter(seq.values()))[ours][0].request_nbytes
    print(f"\nsequential: {ours}, block {config.block_size >> 10} KiB, "
          f"queue depth {config.queue_depth}, threads {config.threads}: {config.in_flight} "
          f"blocks at the device (fio: bs, iodepth, numjobs); ours in {request_nbytes >> 20} MiB "
          f"requests, about {bench.SUBMIT_AHEAD}x that submitted; GB/s = 1e9 bytes/s, "
          f"median [min-max] of {args.repeat}; latency per request")
    rows, ratios = [], {}
    for op, tools in seq.items():
        for tool, runs in tools.items():
            if tool != ours:
                ratios.setdefault(op, {})[tool] = bench.summarize(  # paired: same round
                    a.gbps / b.gbps for a, b in zip(tools[ours], runs, strict=True)).median
            rows.append([op, tool, _fmt([r.gbps for r in runs]),
                         _fmt([r.p50_s for r in runs], 1e3, 1),
                         _fmt([r.p99_s for r in runs], 1e3, 1),
                         f"{ratios[op][tool]:.2f}" if tool != ours else ""])
    _table(["op", "tool", "GB/s", "p50 ms", "p99 ms", "ours/fio"], rows)
    if ratios:
        print("  ours/fio: median over rounds of the ratio within a round")
    result: dict[str, Any] = {
        "config": dataclasses.asdict(config), "ratio_ours_over_fio": ratios,
        "sequential": {op: {t: [r.as_dict() for r in runs] for t, runs in tools.items()}
                       for op, tools in seq.items()}}
    if not small:
        return result
    print(f"\n4 KiB random reads (O_DIRECT): {args.small_requests} requests, "
          f"{config.in_flight} at the device (ours: {bench.SMALL_AHEAD * config.in_flight} "
          "submitted, so ours' latency includes time queued in the engine); "
          "us/req = wall time / requests; CPU = all threads")
    _table(["tool", "", "us/req", "IOPS", "p50 us", "p99 us", "CPU us/req"], [
        [tool, "", _fmt([r.us_per_request for r in runs], 1, 1),
         f"{1e6 / median(runs, 'us_per_request'):.0f}",
         _fmt([r.p50_s for r in runs], 1e6, 0), _fmt([r.p99_s for r in runs], 1e6, 0),
         _fmt([r.cpu_seconds / r.requests * 1e6 for r in runs], 1, 1)]
        for tool, runs in small.items()])
    result["small"] = {tool: [r.as_dict() for r in runs] for tool, runs in small.items()}
    if fio:
        ref = f"fio/{config.backend}" if f"fio/{config.backend}" in small else min(
            (t for t in small if t != ours), key=lambda t: median(small[t], "us_per_request"))
        extra = [a.us_per_request - b.us_per_request
                 for a, b in zip(small[ours], small[ref], strict=True)]
        print(f"  per-request overhead = ours - {ref} us/req, same file, queue depth and jobs, "
              f"so the device time cancels: {_fmt(extra, 1, 1)} us (target < 20 us)")
        result["overhead_us"] = {"reference": ref, "values": extra,
                                 "median": bench.summarize(extra).median}
    return result


def _layer_report(args, config: bench.EngineConfig, workdir: str) -> dict[str, Any]:
    """The fetch and optimizer patterns of infinity/cli/layer_io.py, ours and DeepSpeed's handle
    alternating within each round; the files are removed before the swap-file mix runs."""
    directory = os.path.join(workdir, "layers")
    os.mkdir(directory)
    with tqdm(total=args.repeat * 3 * 2, desc="layers", unit="run", disable=None) as bar:
        try:
            runs, info = layer_io.measure(config, directory, args.size, args.repeat,
                                          on_progress=bar.update)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
    shapes = ", ".join("x".join(map(str, shape)) for shape in info["shapes"])
    print(f"layers: {info['layers']} layers of 7 bf16 tensors ({shapes}), one file per tensor, "
          f"{info['window']} layers in flight; block {config.block_size >> 10} KiB, queue depth "
          f"{config.queue_depth}, threads {config.threads}; median [min-max] of {args.repeat} "
          "rounds, tools alternating")
    for tool, counts in info["extents"].items():
        if counts:
            print(f"  {tool}: files written in {min(counts)}-{max(counts)} extents "
                  f"(median {bench.summarize(counts).median:.0f}, filefrag)")
    if info["deepspeed_skipped"]:
        print(f"  deepspeed: not measured ({info['deepspeed_skipped']})")
    ours, rows, ratios = info["tools"][0], [], {}
    for pattern in layer_io.PATTERNS:
        by_tool = {tool: [r for r in runs if r.tool == tool and r.pattern == pattern]
                   for tool in info["tools"]}
        for tool, mine in by_tool.items():
            if tool == "deepspeed":  # paired: the same round
                ratios[pattern] = bench.summarize(
                    a.gbps / b.gbps for a, b in zip(by_tool[ours], mine, strict=True)).median
            per_request = [r.device_nbytes / r.device_requests / 2**20
                           for r in mine if r.device_requests]
            rows.append([pattern, tool, _fmt([r.seconds for r in mine], 1, 3),
                         _fmt([r.gbps for r in mine]),
                         _fmt(per_request, 1, 1) if per_request else "?",
                         f"{ratios[pattern]:.2f}" if tool == "deepspeed" else ""])
    _table(["pattern", "tool", "seconds", "GB/s", "MiB/device request", "ours/deepspeed"], rows)
    print("  fetch: forward reads; optimizer: reads + write-backs (GB/s counts both). 4K pages: "
          "ours into buffers of ordinary pages. MiB/device request: the disk's own counters over "
          "the run, other processes included")
    return {**info, "runs": [r.as_dict() for r in runs], "ratio_ours_over_deepspeed": ratios}


def _run(args: argparse.Namespace, workdir: str, fio: str | None) -> dict[str, Any]:
    configs = _grid(args)
    results: dict[str, Any] = {
        "tool": PROG, "argv": args.argv, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(), "kernel": platform.release(), "path": os.path.abspath(args.path),
        "filesystem": bench.filesystem_of(args.path), "o_direct": aio.direct_io_supported(workdir),
        "size_bytes": args.size, "units": {"gbps": "1e9 bytes/s", "latency": "seconds"}}
    print(f"{PROG}: {_human(args.size)} in {workdir} ({results['filesystem']}, "
          f"O_DIRECT {'yes' if results['o_direct'] else 'NO: reads may be served from RAM'})")
    if args.mix:
        results["layers"] = _layer_report(args, configs[0], workdir)
        steps = len(bench.mix_schedule(bench.plan_layers(args.size)[1], MIX_PASSES))
        with configs[0].open() as handle, tqdm(total=steps * args.repeat, desc="mix", unit="layer",
                                               disable=None) as bar:
            runs = [bench.mix(handle, workdir, args.size, passes=MIX_PASSES, on_progress=bar.update)
                    for _ in range(args.repeat)]
        results["mix"] = [run.as_dict() for run in runs]
        first = results["mix"][0]
        print(f"mix: {first['backend']}, {first['layers']} layers of "
              f"{_human(first['layer_nbytes'])} in one SwapFile: "
              + ", ".join(f"{t['name']} {'x'.join(map(str, t['shape']))} {t['dtype']}"
                          for t in first["tensors"]))
        print(f"  {MIX_PASSES} training steps: forward reads each layer, backward reads it "
              f"again and writes it back; reads run {first['window']} layers ahead of use, "
              "writes overlap them")
        for key in ("read_gbps", "write_gbps", "combined_gbps"):
            print(f"  {key.replace('_gbps', ''):9} GB/s  "
                  f"{_fmt([run[key] for run in results['mix']])}")
        paused = [run["paused"] for run in results["mix"] if run["paused"] is not None]
        if paused:  # [Note: a disk that pauses] in aio/device_pauses.py
            print(f"  paused    s      {_fmt([p['seconds'] for p in paused], digits=1)} of "
                  f"{_fmt([p['sampled_s'] for p in paused], digits=1)} timed: the disk busy, "
                  f"moving under {device_pauses.MIN_BYTES_PER_S / 1e6:.0f} MB/s "
                  "(other processes' I/O counts)")
        return results
    data = os.path.join(workdir, "data")
    ops = ["read"] if args.read else ["write"] if args.write else ["write", "read"]
    with configs[0].open() as handle, tqdm(total=args.size, desc="lay out", unit="B",
                                           unit_scale=True, disable=None) as bar:
        bench.lay_out(handle, data, args.size, on_progress=bar.update)
    best = configs[0]
    if len(configs) > 1:
        best, results["sweep"] = _sweep(args, configs, data, ops)
        results["best"] = best.aio_section()
    results["report"] = _report(args, best, data, ops, fio)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        _check_path(parser, args)
    except SystemExit as exc:  # argparse: usage errors and --help
        return int(exc.code or 0)
    args.argv = sys.argv[1:] if argv is None else list(argv)
    log_to_stderr(args.verbose)
    fio = bench.find_fio() if args.fio else None
    if args.fio and fio is None:
        print("fio not found: apt-get install fio", file=sys.stderr)
    workdir = tempfile.mkdtemp(prefix=f"{PROG}-", dir=args.path)
    try:
        results = _run(args, workdir, fio)
        if args.json:
            with open(args.json, "w") as out:
                json.dump(results, out, indent=1)
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; removed {workdir}", file=sys.stderr)
        return 130
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
