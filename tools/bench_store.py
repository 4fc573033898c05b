"""Store host <-> NVMe throughput against raw aio on the same files, in the same run.

Streams N tensors through a small host tier, the way the optimizer and the parameter
prefetcher do (fetch i while i+1.. are read ahead and i-1 is written back), once through
aio.Handle directly and once through TensorStore with the same engine settings, and prints both
and their ratio. A ratio near 1.0 means the store adds no cost over the disk.

    python -m tools.bench_store --path /tmp --tensors 16 --tensor-size 64M
    python -m tools.bench_store --path /nvme --mode optimizer --params 50M --tile 4M
    python -m tools.bench_store --path /nvme --mode optimizer --params 50M --checksum ab
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import shutil
import statistics
import sys
import tempfile
import time

import torch

import aio
from infinity.cli import nvme_measure as bench
from infinity.cli.args import parse_size
from infinity.optim import SwappedOptimizer, UnitSpec
from infinity.store import TensorStore

GB = bench.GB


def store_stream(store: TensorStore, keys: list[str], nbytes: int, window: int,
                 modify: bool) -> float:
    """The same pattern through the store's fetch / prefetch / release; GB/s."""
    start = time.perf_counter()
    for i, key in enumerate(keys):
        store.prefetch(keys[i + 1:i + 1 + window])
        t = store.fetch(key, "host").result()
        if modify:
            t[:8].add_(1)
        store.release(key, "host", dirty=modify)
    store.flush()
    moved = len(keys) * nbytes * (2 if modify else 1)
    return moved / (time.perf_counter() - start) / GB


def bench_stream(args: argparse.Namespace, directory: str) -> dict:
    """Raw and store runs alternate, and swap order every round, so the drift and the burst
    credit of a shared disk hit both alike; the ratio is the median of the per-round ratios."""
    n, nbytes, window = args.tensors, args.tensor_size, args.window
    budgets = {"host": (window + 2) * nbytes + (1 << 20), "nvme": n * nbytes + (1 << 20)}
    rounds: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    with aio.Handle(**_engine(args)) as handle, \
            aio.SwapFile(f"{directory}/raw.swap", n * nbytes) as swap, \
            TensorStore(budgets, nvme_path=directory, aio_handle=handle, keep_timeline=False,
                        checksum=args.checksum == "on") as store:
        extents = [swap.allocate(nbytes) for _ in range(n)]
        keys = [f"t{i}" for i in range(n)]
        fill = aio.aligned_empty(nbytes).fill_(7)
        for e, key in zip(extents, keys):
            swap.write(handle, e, fill).wait()
            store.put(key, fill, "nvme")
        for r in range(args.repeat):
            for modify in (False, True):
                if r % 2 == 0:
                    raw_gbps = bench.window_stream(handle, swap, extents, nbytes, window, modify)
                    store_gbps = store_stream(store, keys, nbytes, window, modify)
                else:
                    store_gbps = store_stream(store, keys, nbytes, window, modify)
                    raw_gbps = bench.window_stream(handle, swap, extents, nbytes, window, modify)
                rounds[modify].append((raw_gbps, store_gbps))
    results = {}
    for modify, label in ((False, "read stream"), (True, "read+write stream")):
        pairs = rounds[modify]
        results[label] = {
            "raw_gbps": statistics.median(p[0] for p in pairs),
            "store_gbps": statistics.median(p[1] for p in pairs),
            "ratio": statistics.median(p[1] / p[0] for p in pairs),
            "ratio_range": (f"{min(p[1] / p[0] for p in pairs):.2f}-"
                            f"{max(p[1] / p[0] for p in pairs):.2f}"),
        }
    return results


def bench_optimizer(args: argparse.Namespace, directory: str) -> dict:
    """One SwappedOptimizer step against the floor: 24 bytes/param over the raw read+write stream.

    The parameters are float32 units of --tile elements each, values at home on NVMe (the master:
    4 bytes a parameter) and tiles holding the moments (8 bytes), stepped one after another with
    the next unit read ahead, as the engine's optimizer worker does: 12 bytes a parameter read
    and 12 written (`nvme_bytes_per_param` says what a step moved: a little less where the host
    tier still holds copies from the step before). Raw stream and step rounds alternate, and
    swap order every round, so a shared machine's drift hits both alike; `ratio` is best step
    over the floor of the best raw stream, `round_ratio` the median (and range) of the
    per-round ratios. With --checksum ab, two stores (checksums on and off) step in turns,
    swapping order every round, and the cost of the checksums is the median of the per-round
    ratios."""
    tile_nbytes = 12 * args.tile
    tiles = -(-args.params // args.tile)
    numels = [min(args.tile, args.params - u * args.tile) for u in range(tiles)]
    variants = {"ab": [True, False], "on": [True], "off": [False]}[args.checksum]
    budgets = {"host": 4 * tile_nbytes + (1 << 20), "nvme": tiles * tile_nbytes + (1 << 20)}
    grad = torch.full((args.tile,), 1e-3)
    with aio.Handle(**_engine(args)) as handle, \
            aio.SwapFile(f"{directory}/raw.swap", tiles * tile_nbytes) as swap, \
            contextlib.ExitStack() as stack:
        extents = [swap.allocate(tile_nbytes) for _ in range(tiles)]
        for e in extents:
            swap.write(handle, e, aio.aligned_empty(tile_nbytes).zero_()).wait()
        steppers = {}
        for checksum in variants:
            store = stack.enter_context(TensorStore(budgets, nvme_path=directory,
                                                    aio_handle=handle, keep_timeline=False,
                                                    checksum=checksum))
            for u, numel in enumerate(numels):
                store.put(f"unit{u}", torch.zeros(numel), "nvme")
            units = [UnitSpec(n, torch.float32, f"unit{u}") for u, n in enumerate(numels)]
            steppers[checksum] = (SwappedOptimizer(units, store, tile_numel=args.tile), store)

        def raw() -> float:
            return bench.window_stream(handle, swap, extents, tile_nbytes, 1, True)

        def step(checksum: bool) -> tuple[float, float]:
            opt, store = steppers[checksum]
            before = _nvme_nbytes(store)
            start = time.perf_counter()
            for u, numel in enumerate(numels):
                if u + 1 < len(numels):
                    opt.prefetch_unit(u + 1)
                opt.step_unit(u, grad[:numel])
            opt.finish_step()
            store.flush()
            return time.perf_counter() - start, (_nvme_nbytes(store) - before) / args.params

        raws: list[float] = []
        steps: dict[bool, list[tuple[float, float]]] = {c: [] for c in variants}
        for r in range(args.repeat + 1):  # round 0 warms the arena and caches: not counted
            order = variants if r % 2 == 0 else variants[::-1]
            if r % 2 == 0:
                raws.append(raw())
            for checksum in order:
                steps[checksum].append(step(checksum))
            if r % 2 == 1:
                raws.append(raw())
    raws = raws[1:]
    raw_gbps = max(raws)
    floor_s = 24 * args.params / (raw_gbps * GB)
    results = {}
    for checksum in variants:
        times = [t for t, _ in steps[checksum][1:]]
        per_round = [t / (24 * args.params / (g * GB)) for t, g in zip(times, raws)]
        results[f"optimizer step (checksum {'on' if checksum else 'off'})"] = {
            "params": args.params, "tile": args.tile, "step_s": min(times),
            "median_s": statistics.median(times), "raw_gbps": raw_gbps,
            "floor_s": floor_s, "ratio": min(times) / floor_s,
            "round_ratio": statistics.median(per_round),
            "round_ratio_range": f"{min(per_round):.2f}-{max(per_round):.2f}",
            "nvme_bytes_per_param": statistics.median(b for _, b in steps[checksum][1:])}
    if len(variants) == 2:
        ratios = [on / off for (on, _), (off, _) in zip(steps[True][1:], steps[False][1:])]
        results["checksum cost"] = {"median_ratio": statistics.median(ratios),
                                    "ratio_range": f"{min(ratios):.3f}-{max(ratios):.3f}"}
    return results


def _nvme_nbytes(store: TensorStore) -> int:
    """Bytes the store has moved to and from NVMe so far."""
    return sum(m["nbytes"] for direction, m in store.stats()["moves"].items()
               if "nvme" in direction)


def _engine(args: argparse.Namespace) -> dict:
    return {"block_size": args.block_size, "queue_depth": args.queue_depth, "threads": args.threads,
            "backend": args.backend}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--path", required=True, help="directory on the disk to measure")
    parser.add_argument("--mode", choices=["stream", "optimizer"], default="stream",
                        help="stream: store vs raw aio; "
                             "optimizer: SwappedOptimizer step vs the I/O floor")
    parser.add_argument("--tensors", type=int, default=16, help="tensors streamed (stream mode)")
    parser.add_argument("--tensor-size", type=parse_size, default="64M", help="bytes per tensor")
    parser.add_argument("--window", type=int, default=2, help="tensors read ahead")
    parser.add_argument("--params", type=parse_size, default="50M",
                        help="parameters (optimizer mode)")
    parser.add_argument("--tile", type=parse_size, default="4M", help="elements per optimizer tile")
    parser.add_argument("--checksum", choices=["on", "off", "ab"], default="off",
                        help="the store's crc32c of NVMe data (off, as the store defaults); "
                             "ab: on and off in turns (optimizer mode)")
    parser.add_argument("--block-size", type=parse_size, default="1M", help="aio block size")
    parser.add_argument("--queue-depth", type=int, default=32, help="aio queue depth")
    parser.add_argument("--threads", type=int, default=1, help="aio queues")
    parser.add_argument("--backend", default="auto", help="aio backend")
    parser.add_argument("--repeat", type=int, default=4,
                        help="rounds per figure (stream: medians; optimizer: best and medians)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.mode == "stream" and args.tensors <= 2 * (args.window + 2):
        parser.error(f"--tensors must be more than twice --window + 2 ({2 * (args.window + 2)}): "
                     f"with fewer, the store's host tier holds them all and serves repeats "
                     f"from memory")
    if args.mode == "stream" and args.checksum == "ab":
        parser.error("--checksum ab is for --mode optimizer")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        directory = tempfile.mkdtemp(prefix="infinity-bench-store-", dir=args.path)
    except OSError as exc:
        print(f"error: cannot use --path {args.path}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        run = bench_stream if args.mode == "stream" else bench_optimizer
        results = run(args, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    for label, r in results.items():
        print(f"{label:>18}: " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in r.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
