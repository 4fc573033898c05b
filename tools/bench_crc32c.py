"""Benchmark aio.crc32c against memcpy on one core.

Example (from the repository root, after `pip install -e .` or `python csrc/build_aio.py`):

    python -m tools.bench_crc32c --size 64M --rounds 30

Every row is charged the buffer's bytes per call: a checksum reads them once, memcpy (numpy
`copyto` into a second buffer, libc memcpy, one thread) reads them and writes them once. "x memcpy"
is a row's GB/s over memcpy's, both timed in the same run in turns (one call of each, repeated),
so a change in machine load hits every row alike. Medians, with the range over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable

import numpy as np

import aio
from infinity.cli.args import parse_size, time_in_turns


def _rows(nbytes: int) -> dict[str, Callable[[], object]]:
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    rows: dict[str, Callable[[], object]] = {"memcpy": lambda: np.copyto(dst, src)}
    if aio.crc32c_hardware_available():
        rows["crc32c hardware (SSE4.2)"] = lambda: aio.crc32c(src, implementation="hardware")
    rows["crc32c portable (table)"] = lambda: aio.crc32c(src, implementation="portable")
    return rows


def measure(nbytes: int, rounds: int, warmup: int = 2) -> dict[str, list[float]]:
    """GB/s of each row per round (buffer bytes / seconds), timed in turns."""
    seconds = time_in_turns(_rows(nbytes), rounds, warmup)
    return {name: [nbytes / t / 1e9 for t in values] for name, values in seconds.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_crc32c", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--size", type=parse_size, default="64M",
                        help="bytes per call (K/M/G suffixes)")
    parser.add_argument("--rounds", type=int, default=30, help="timed calls of each row")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    gbps = measure(args.size, args.rounds)
    memcpy = statistics.median(gbps["memcpy"])
    print(f"{args.size} bytes per call, {args.rounds} rounds, one thread")
    print(f"{'row':<28}{'GB/s median':>12}{'range':>16}{'x memcpy':>10}")
    for name, values in gbps.items():
        median = statistics.median(values)
        print(f"{name:<28}{median:>12.2f}{min(values):>8.2f}-{max(values):<7.2f}"
              f"{median / memcpy:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
