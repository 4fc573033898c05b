"""Benchmark arena compaction throughput against memcpy bandwidth measured in the same run.

Example (from the repository root):

    python -m tools.bench_arena --arena-mib 512 --block-kib 1024 --repeats 5

Each repeat fills the arena with blocks, writes them, frees some, and times ``Arena.compact()``:

- ``half``: every other block is freed, so half the data moves and the gaps it slides over are
  at least one block (no move overlaps itself; each lands on a hole or a source long read);
- ``sliver``: big blocks separated by 4 KiB slivers; the slivers are freed, so almost all data
  moves, the first moves overlap their own source by all but a few KiB, and each move lands on
  the source of the one before until the gap has grown to twice the block size.

GB/s is bytes moved over compaction time (median over repeats). "of memcpy" divides it by the
bandwidth of torch ``copy_`` between two buffers as large as the bytes moved, timed in turns with
the compactions so load changes hit both alike; both count each byte copied once. Target: >= 50%.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import sys
import time

import torch
from tqdm import tqdm

from infinity.memory import Arena, Block

SLIVER_NBYTES = 4096


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fragment(arena: Arena, pattern: str, block_nbytes: int) -> list[tuple[Block, int]]:
    """Fill the arena, mark every block, free the pattern's holes; returns the survivors."""
    if pattern == "sliver":
        unit = [(SLIVER_NBYTES, False), (block_nbytes, True)]  # (nbytes, kept)
    else:
        unit = [(block_nbytes, False), (block_nbytes, True)]
    layout: list[tuple[int, bool]] = []
    used = 0
    for nbytes, kept in itertools.cycle(unit):
        if used + nbytes > arena.capacity_nbytes:
            break
        layout.append((nbytes, kept))
        used += nbytes
    blocks = [arena.alloc(nbytes, torch.uint8) for nbytes, _ in layout]  # all, then free
    survivors = []
    for i, (block, (_, kept)) in enumerate(zip(blocks, layout, strict=True)):
        marker = i % 251
        block.tensor.fill_(marker)
        if kept:
            survivors.append((block, marker))
        else:
            arena.free(block)
    return survivors


def _run_pattern(
    arena: Arena, pattern: str, block_nbytes: int, repeats: int, progress: bool
) -> tuple[int, float, float]:
    """(bytes moved, median compaction s, median memcpy s) for one pattern."""
    moved_nbytes, compact_s, copy_s = 0, [], []
    src = dst = None
    for _ in tqdm(range(repeats), desc=pattern, disable=not progress, file=sys.stderr):
        survivors = _fragment(arena, pattern, block_nbytes)
        _sync(arena.device)
        start = time.perf_counter()
        moved_nbytes = arena.compact()
        _sync(arena.device)
        compact_s.append(time.perf_counter() - start)
        for block, marker in survivors:  # spot-check that every moved block kept its bytes
            ends = block.tensor[[0, -1]]
            if not bool((ends == marker).all()):
                raise RuntimeError(f"{block!r} lost its contents during compaction")
            arena.free(block)
        if src is None:
            src = torch.ones(moved_nbytes, dtype=torch.uint8, device=arena.device)
            dst = torch.zeros_like(src)
        _sync(arena.device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(arena.device)
        copy_s.append(time.perf_counter() - start)
    return moved_nbytes, statistics.median(compact_s), statistics.median(copy_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--arena-mib", type=int, default=512, help="arena capacity in MiB")
    parser.add_argument("--block-kib", type=int, default=1024, help="size of each live block")
    parser.add_argument("--repeats", type=int, default=5, help="compactions timed per pattern")
    parser.add_argument(
        "--patterns",
        nargs="+",
        choices=["half", "sliver"],
        default=["half", "sliver"],
        help="free-space layouts to time",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument(
        "--threads", type=int, default=torch.get_num_threads(), help="torch intra-op threads"
    )
    parser.add_argument(
        "--min-ratio", type=float, default=0.0, help="exit 1 if any pattern is below this"
    )
    parser.add_argument("--verbose", action="store_true", help="log arena events")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    if args.repeats < 1 or args.arena_mib < 1 or args.block_kib < 4:
        parser.error("need --repeats >= 1, --arena-mib >= 1 and --block-kib >= 4")
    torch.set_num_threads(args.threads)
    progress = sys.stderr.isatty()

    arena = Arena(args.arena_mib << 20, device=args.device, pinned=False, alignment=4096)
    print(
        f"# arena {args.arena_mib} MiB on {arena.device}, blocks {args.block_kib} KiB, "
        f"{args.threads} threads, median of {args.repeats}"
    )
    print("| pattern | moved MiB | compaction ms | compaction GB/s | memcpy GB/s | of memcpy |")
    print("|---|---:|---:|---:|---:|---:|")
    worst = float("inf")
    try:
        for pattern in args.patterns:
            moved, compact_s, copy_s = _run_pattern(
                arena, pattern, args.block_kib << 10, args.repeats, progress
            )
            compact_gbps, copy_gbps = moved / compact_s / 1e9, moved / copy_s / 1e9
            ratio = compact_gbps / copy_gbps
            worst = min(worst, ratio)
            print(
                f"| {pattern} | {moved / 2**20:.0f} | {compact_s * 1e3:.1f} | "
                f"{compact_gbps:.2f} | {copy_gbps:.2f} | {ratio:.0%} |"
            )
    finally:
        arena.close()
    return 1 if worst < args.min_ratio else 0


if __name__ == "__main__":
    sys.exit(main())
