"""Benchmark the aio engine's cost per piece, two builds in turns, on a file in memory.

    python -m tools.bench_fault_path --before /tmp/old-checkout --rounds 6
    python -m tools.bench_fault_path --before OLD --after . --block-size 4K,64K --threads 1,2

Every piece a request is cut into passes the engine's hot path once (its fault check
included), so small blocks and a file that lives in memory (tmpfs `--path /dev/shm`: no disk,
only the engine's and the kernel's CPU work) show a cost per piece that a disk would hide.
`--before` and `--after` are checkouts with their native aio library built (`python setup.py
build_ext --inplace` in each); each round runs one child process per checkout, importing that
checkout's `aio`, in alternating order, so a change in machine load hits both alike.

A child reads the whole file into one buffer in requests of --request-size, waits for all, then
writes it back, --passes times after one untimed pass, with two handles in turns: one with no
fault installed (production) and one holding a fault that never fires (nth = 2**62: every piece
takes the armed path of the fault check). Figures are ns of wall time per piece and ns of CPU
time (all threads) per piece: medians over passes, then medians over rounds with their range;
after/before is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

NEVER = 1 << 62  # a fault's nth no run reaches: the handle stays armed
VARIANTS = ("off", "armed")


def _timed_pass(handle, buffer, path: str, request: int, op: str) -> tuple[float, float]:
    """Wall and CPU seconds to move the whole file in one direction, all requests in flight."""
    wall, cpu = time.perf_counter(), time.process_time()
    move = handle.read if op == "read" else handle.write
    requests = [move(buffer[at:at + request], path, at) for at in range(0, len(buffer), request)]
    for req in requests:
        req.wait()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure_child(spec: dict) -> dict:
    """Run in the child: ns per piece for every (block size, threads, variant, op)."""
    import aio  # the checkout on PYTHONPATH, which differs between children

    path, size, request = spec["file"], spec["size"], spec["request_size"]
    buffer = aio.aligned_empty(size)
    with open(path, "rb") as file:
        expected = file.read()
    results = {}
    for block in spec["block_sizes"]:
        for threads in spec["threads"]:
            handles = {v: aio.Handle(block_size=block, queue_depth=spec["queue_depth"],
                                     threads=threads, backend=spec["backend"])
                       for v in VARIANTS}
            handles["armed"].inject(aio.Fault(op="any", nth=NEVER))
            try:
                for variant, handle in handles.items():  # untimed pass; checks the bytes
                    buffer.zero_()
                    _timed_pass(handle, buffer, path, request, "read")
                    if buffer.numpy().tobytes() != expected:
                        raise RuntimeError(f"{variant}: the read returned other bytes")
                    _timed_pass(handle, buffer, path, request, "write")
                times = {(v, op): [] for v in VARIANTS for op in ("read", "write")}
                for _ in range(spec["passes"]):
                    for variant, handle in handles.items():
                        for op in ("read", "write"):
                            times[variant, op].append(
                                _timed_pass(handle, buffer, path, request, op))
            finally:
                for handle in handles.values():
                    handle.close()
            pieces = size // block
            for (variant, op), runs in times.items():
                key = f"{block}/{threads}/{variant}/{op}"
                results[key] = {
                    "wall_ns": statistics.median(w for w, _ in runs) / pieces * 1e9,
                    "cpu_ns": statistics.median(c for _, c in runs) / pieces * 1e9}
    return results


def run_child(checkout: str, spec: dict) -> dict:
    """One child importing `aio` from `checkout`; its results."""
    env = {**os.environ, "PYTHONPATH": os.path.abspath(checkout)}
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the child for {checkout} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _write_file(path: str, size: int) -> None:
    """A file of `size` bytes with a pattern, so a read that returns zeros is caught."""
    chunk = bytes(range(251)) * ((1 << 20) // 251 + 1)
    with open(path, "wb") as out:
        for at in range(0, size, 1 << 20):
            out.write(chunk[:min(1 << 20, size - at)])


def _summary(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:.0f} ({min(values):.0f}-{max(values):.0f})"


def report(rounds: list[dict[str, dict]], names: tuple[str, str]) -> list[str]:
    """Table lines: per config, both builds' ns per piece and after/before per round."""
    before, after = names
    lines = [f"{'block':>6} {'thr':>3} {'fault':>5} {'op':>5} | "
             f"{'wall ns/piece ' + before:>24} {'wall ns/piece ' + after:>24} "
             f"{'after/before':>18} | {'CPU ns ' + before:>16} {'CPU ns ' + after:>16} "
             f"{'after/before':>18}"]
    for key in rounds[0][before]:
        block, threads, variant, op = key.split("/")
        cells = []
        for field in ("wall_ns", "cpu_ns"):
            a = [r[before][key][field] for r in rounds]
            b = [r[after][key][field] for r in rounds]
            ratios = [y / x for x, y in zip(a, b)]
            cells.append(f"{_summary(a):>24} {_summary(b):>24} "
                         f"{statistics.median(ratios):>6.3f} ({min(ratios):.2f}-"
                         f"{max(ratios):.2f})")
        lines.append(f"{int(block) >> 10:>5}K {threads:>3} {variant:>5} {op:>5} | "
                     f"{cells[0]} | {cells[1]}")
    return lines


def _native_built(checkout: str) -> bool:
    folder = os.path.join(checkout, "aio")
    return os.path.isdir(folder) and any(n.startswith("_aio_cffi") for n in os.listdir(folder))


def main(argv: list[str] | None = None) -> int:
    from infinity.cli.args import parse_size

    def sizes(text: str) -> list[int]:
        return [parse_size(item) for item in text.split(",") if item.strip()]

    parser = argparse.ArgumentParser(prog="python -m tools.bench_fault_path", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="checkout A (its aio built in place)")
    parser.add_argument("--after", default=".", help="checkout B (default: this one)")
    parser.add_argument("--path", default="/dev/shm", help="directory of the file (memory "
                        "backed for the CPU cost alone)")
    parser.add_argument("--size", type=parse_size, default="256M", help="bytes of the file")
    parser.add_argument("--request-size", type=parse_size, default="8M",
                        help="bytes per request (all in flight at once)")
    parser.add_argument("--block-size", type=sizes, default="4K,64K",
                        help="bytes per piece, comma list")
    parser.add_argument("--threads", type=lambda t: [int(x) for x in t.split(",")], default="1,2",
                        help="queues of the handle, comma list")
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--passes", type=int, default=5, help="timed passes per child")
    parser.add_argument("--rounds", type=int, default=4, help="children per checkout")
    parser.add_argument("--json", metavar="FILE", help="also write every round's figures")
    args = parser.parse_args(argv)
    for name in ("before", "after"):
        if not _native_built(getattr(args, name)):
            parser.error(f"--{name} {getattr(args, name)}: no aio/_aio_cffi*.so there (run "
                         "`python setup.py build_ext --inplace` in it)")
    if (args.size % args.request_size or args.rounds < 1 or args.passes < 1
            or any(args.request_size % b for b in args.block_size)):
        parser.error("--size must be a multiple of --request-size, which must be one of every "
                     "--block-size; --rounds and --passes >= 1")
    names = ("before", "after")
    load = os.getloadavg()
    rounds = []
    with tempfile.TemporaryDirectory(prefix="bench-fault-path-", dir=args.path) as folder:
        data = os.path.join(folder, "data")
        _write_file(data, args.size)
        spec = {"file": data, "size": args.size, "request_size": args.request_size,
                "block_sizes": args.block_size, "threads": args.threads,
                "queue_depth": args.queue_depth, "backend": args.backend,
                "passes": args.passes}
        for i in range(args.rounds):
            order = names if i % 2 == 0 else names[::-1]
            rounds.append({name: run_child(getattr(args, name), spec) for name in order})
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr)
    print(f"before {os.path.abspath(args.before)}, after {os.path.abspath(args.after)}; "
          f"file {args.size >> 20} MiB in {args.path}, requests of {args.request_size >> 10} "
          f"KiB, queue depth {args.queue_depth}, backend {args.backend}, {args.rounds} rounds "
          f"of {args.passes} passes; load average {load[0]:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after")
    print("\n".join(report(rounds, names)))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "json"},
                       "load": [load[0], os.getloadavg()[0]], "rounds": rounds}, out)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(measure_child(json.loads(sys.argv[2]))))
        sys.exit(0)
    sys.exit(main())
