"""Benchmark the CPU Adam kernel against torch's AdamW and the machine's memory bandwidth.

Example (from the repository root, after `pip install -e .` or `python csrc/build_adam.py`):

    python -m tools.bench_adam --params 50000000 --grad-dtype fp32 --out-dtype bf16

Every Adam row is charged the same useful bytes per parameter, the traffic of a one-pass update:
grad read (4 for fp32, 2 for bf16/fp16) + param, exp_avg and exp_avg_sq each read and written
(3 x 8 = 24) + the low-precision copy written (2 for bf16/fp16, 0 for none). fp32 grads with a
bf16 copy are 30 bytes per parameter. GB/s is those bytes over the median step time.

The memory bound is the fastest of three streaming references timed in the same run, counting
bytes read + written: torch `copy_` between two large fp32 buffers, an in-place `mul_` of one,
and libc memcpy (numpy `copyto`) split over the kernel's thread count. "of bound" is a row's
GB/s over it, i.e. how close a step comes to moving its bytes once at the speed memory allows.
All rows are timed in turns (one step of each, repeated), so a change in machine load hits
every row alike. torch rows always use fp32 grads (torch needs grad dtype == param dtype); the
"+ copy_" row adds the separate bf16/fp16 copy our kernel fuses.

The compressed-state rows (`--formats`, moments/master as in `infinity.optim.StateFormat`) step
the same parameters through `StateKernel` with the same grads and 16-bit values (bf16 if
--out-dtype is none: without a master they are the parameters). Each is charged its own bytes:
the grad, the master and both moments (with their 8-bit scales) read and written, the values
written (with a master) or read and written (without). "vs fp32" is the fp32 kernel's time per
step over the row's: above 1 the row updates a parameter faster.
"""

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from infinity.cli.args import time_in_turns
from infinity.memory import ThreadPool
from infinity.optim import StateFormat, StateKernel, adam_step, resolve_isa

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HYPER = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}


def _time_round_robin(fns: dict[str, Callable[[], None]], steps: int, warmup: int
                      ) -> dict[str, float]:
    """Median seconds per call of each fn, timed in turns so load changes hit every row alike."""
    return {name: statistics.median(t) for name, t in time_in_turns(fns, steps, warmup).items()}


def _memory_rows(nbytes: int, threads: int) -> dict[str, tuple[Callable[[], None], int]]:
    """Streaming references: (fn, bytes read + written per call)."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    pieces = [(d.numpy(), s.numpy()) for d, s in zip(dst.chunk(threads), src.chunk(threads),
                                                     strict=True)]
    pool = ThreadPoolExecutor(threads)  # numpy's copy releases the GIL: one memcpy per thread

    def memcpy() -> None:
        list(pool.map(lambda ds: np.copyto(*ds), pieces))
    return {
        "memory: torch copy_": (lambda: dst.copy_(src), 2 * nbytes),
        "memory: torch in-place mul_": (lambda: src.mul_(1.0), 2 * nbytes),
        f"memory: memcpy, {threads} threads": (memcpy, 2 * nbytes),
    }


def _state(n: int, grad_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    return (torch.randn(n), torch.randn(n).to(grad_dtype), torch.zeros(n), torch.zeros(n))


def _ours(n: int, args: argparse.Namespace) -> Callable[[], None]:
    param, grad, m, v = _state(n, DTYPES[args.grad_dtype])
    out = None if args.out_dtype == "none" else torch.empty(n, dtype=DTYPES[args.out_dtype])
    counter = iter(range(1, 1 << 62))

    def run() -> None:
        adam_step(param, grad, m, v, step=next(counter), adamw=True, out_lowp=out,
                  threads=args.threads, isa=args.isa, **HYPER)
    return run


def _compressed(n: int, fmt: StateFormat, args: argparse.Namespace, pool: ThreadPool
                ) -> Callable[[], None]:
    """StateKernel over one segment of n elements in fmt (state zeroed: Adam's initial state)."""
    values_dtype = DTYPES["bf16" if args.out_dtype == "none" else args.out_dtype]
    layout = fmt.layout(n, values_dtype)
    views = layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8))
    values = torch.randn(n).to(values_dtype)
    if "master" in views:
        views["master"].copy_(values.float())
    state = layout.segment(views, 0, n)
    grad = torch.randn(n).to(DTYPES[args.grad_dtype])
    counter = iter(range(1, 1 << 62))

    def run() -> None:
        StateKernel(fmt, step=next(counter), adamw=True, pool=pool, isa=args.isa, **HYPER)(
            state, grad, values)
    return run


def _compressed_bytes(fmt: StateFormat, grad_dtype: str) -> float:
    """Bytes one parameter moves through the kernel in fmt (with 16-bit values)."""
    master = fmt.keeps_master(torch.bfloat16)
    values = 2 if master else 4  # written from the master, or read and written
    return DTYPES[grad_dtype].itemsize + 2 * fmt.bytes_per_element(torch.bfloat16) + values


def _parse_formats(text: str) -> list[StateFormat]:
    formats = []
    for item in filter(None, text.split(",")):
        moments, _, master = item.strip().partition("/")
        try:
            formats.append(StateFormat(moments, master or "fp32"))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"--formats item {item!r}: {exc}") from exc
    return formats


def _torch(n: int, args: argparse.Namespace, fused: bool, copy_out: bool
           ) -> Callable[[], None] | str:
    """torch.optim.AdamW on the same sizes (fp32 grads: torch needs grad dtype == param dtype)."""
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    out = torch.empty(n, dtype=DTYPES[args.out_dtype]) if copy_out else None
    try:
        opt = torch.optim.AdamW([param], lr=HYPER["lr"], betas=(HYPER["beta1"], HYPER["beta2"]),
                                eps=HYPER["eps"], weight_decay=HYPER["weight_decay"],
                                fused=fused or None, foreach=None if fused else True)
        opt.step()
    except (RuntimeError, ValueError) as exc:
        return f"unavailable: {exc}"

    def run() -> None:
        opt.step()
        if out is not None:
            out.copy_(param.detach())
    return run


def _deepspeed(n: int, args: argparse.Namespace) -> Callable[[], None] | str:
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return "not installed"
    param = torch.nn.Parameter(torch.randn(n))
    param.grad = torch.randn(n)
    opt = DeepSpeedCPUAdam([param], lr=HYPER["lr"], weight_decay=HYPER["weight_decay"])
    return opt.step


def _bytes_per_param(grad_dtype: str, out_dtype: str) -> int:
    grad = DTYPES[grad_dtype].itemsize
    out = 0 if out_dtype == "none" else DTYPES[out_dtype].itemsize
    return grad + 3 * 2 * 4 + out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--params", type=int, default=50_000_000, help="parameters per step")
    parser.add_argument("--grad-dtype", choices=sorted(DTYPES), default="fp32",
                        help="gradient dtype of our kernel (torch rows always use fp32)")
    parser.add_argument("--out-dtype", choices=["bf16", "fp16", "none"], default="bf16",
                        help="low-precision copy of the new params")
    parser.add_argument("--threads", type=int, default=None,
                        help="kernel threads; None: every core this process may use")
    parser.add_argument("--isa", choices=["auto", "scalar", "avx2", "avx512"], default="auto",
                        help="instruction set of our kernel")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per row")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per row")
    parser.add_argument("--copy-mib", type=int, default=1024,
                        help="buffer size of the memory-bandwidth references (MiB)")
    parser.add_argument("--formats", type=_parse_formats,
                        default="bf16/fp32,int8/fp32,fp32/none,bf16/none,int8/none",
                        help="compressed state formats to time, moments/master, comma-separated "
                             "('' for none)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    n = args.params
    bpp = _bytes_per_param(args.grad_dtype, args.out_dtype)
    threads = args.threads or len(os.sched_getaffinity(0))
    rows: dict[str, tuple[Callable[[], None], int]] = _memory_rows(args.copy_mib << 20, threads)
    candidates = {
        f"infinity CPU Adam, {args.grad_dtype} grads, {args.out_dtype} out": _ours(n, args),
        "torch AdamW fused=True (no copy-out)": _torch(n, args, fused=True, copy_out=False),
        "torch AdamW foreach=True (no copy-out)": _torch(n, args, fused=False, copy_out=False),
        "DeepSpeedCPUAdam": _deepspeed(n, args),
    }
    if args.out_dtype != "none":
        candidates[f"torch AdamW fused=True + {args.out_dtype} copy_"] = _torch(
            n, args, fused=True, copy_out=True)
    skipped = {name: fn for name, fn in candidates.items() if isinstance(fn, str)}
    rows.update({name: (fn, bpp * n) for name, fn in candidates.items() if name not in skipped})
    with ThreadPool(threads) as pool:
        for fmt in args.formats or []:
            name = f"infinity StateKernel, moments {fmt.moments}, master {fmt.master}"
            nbytes = _compressed_bytes(fmt, args.grad_dtype) * n
            rows[name] = (_compressed(n, fmt, args, pool), nbytes)
        seconds = _time_round_robin({name: fn for name, (fn, _) in rows.items()}, args.steps,
                                    args.warmup)
    gbps = {name: rows[name][1] / s / 1e9 for name, s in seconds.items()}
    bound_gbps = max(gbps[name] for name in gbps if name.startswith("memory:"))
    fp32_kernel = seconds[next(name for name in candidates if name.startswith("infinity"))]

    print(f"# {n:,} params, isa={resolve_isa(args.isa)}, kernel threads={threads}, "
          f"torch threads={torch.get_num_threads()}, median of {args.steps} steps")
    print(f"# bytes/param = {bpp} (torch rows are charged the same bytes); memory bound = "
          f"{bound_gbps:.1f} GB/s -> {bpp * n / bound_gbps / 1e6:.1f} ms/step")
    print("| implementation | ms/step | GB/s | of bound | vs fp32 |")
    print("|---|---:|---:|---:|---:|")
    for name, s in seconds.items():
        ratio = "" if name.startswith("memory:") else f"{fp32_kernel / s:.2f}"
        print(f"| {name} | {s * 1e3:.1f} | {gbps[name]:.1f} | {gbps[name] / bound_gbps:.0%} | "
              f"{ratio} |")
    for name, why in skipped.items():
        print(f"| {name} | {why} | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
