"""The gradient norm's terms: the native sum of squares against torch's float32 norm and sum.

At the boundary micro-batch the engine takes every gradient piece's sum of squares (the global
norm's term, and the inf/nan check in the same pass: infinity/zero/grads.py). This
times that pass over the gradient pieces of `tools/bench_step.py`'s GPT (bf16 by default, the
294 M model's shapes unless told otherwise), in turns with what the engine did before (torch's
float32 `vector_norm` of each piece, and the float32 `sum` the check took), and with a
single-thread memcpy of the same bytes as the memory bound (the native pass runs on the calling
thread; torch's reductions use its intra-op threads). Each row gives wall and CPU seconds (all
threads) per pass, GB/s of gradient bytes read, and its relative error against the exact sum
(the squares summed in float64 by torch, once: exact to ~1e-15 here).

    python -m tools.bench_grad_norm                       # 294 M GPT pieces, bf16
    python -m tools.bench_grad_norm --dtype fp32 --layers 4 --rounds 5
"""

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from infinity.cli.args import time_in_turns
from infinity.optim import available_isas, sum_squares

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def gpt_piece_sizes(layers: int, d_model: int, vocab: int, seq: int) -> list[int]:
    """Element counts of a GPT-2's parameters (weights and biases), as bench_step builds it."""
    block = [d_model, d_model,                       # ln_1
             d_model * 3 * d_model, 3 * d_model,     # attn.c_attn
             d_model * d_model, d_model,             # attn.c_proj
             d_model, d_model,                       # ln_2
             d_model * 4 * d_model, 4 * d_model,     # mlp.c_fc
             4 * d_model * d_model, d_model]         # mlp.c_proj
    return [vocab * d_model, seq * d_model] + block * layers + [d_model, d_model]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=16384)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--rounds", type=int, default=5, help="timed passes per row, in turns")
    args = parser.parse_args(argv)
    if min(args.layers, args.d_model, args.vocab, args.seq, args.rounds) < 1:
        parser.error("--layers, --d-model, --vocab, --seq and --rounds must be at least 1")

    torch.manual_seed(0)
    dtype = DTYPES[args.dtype]
    pieces = [torch.randn(n).mul_(1e-3).to(dtype)
              for n in gpt_piece_sizes(args.layers, args.d_model, args.vocab, args.seq)]
    nbytes = sum(p.numel() * p.element_size() for p in pieces)
    exact = math.fsum(float(p.double().square().sum()) for p in pieces)
    src = np.empty(nbytes, np.uint8)
    dst = np.empty_like(src)
    src.fill(1)

    rows: dict[str, Callable[[], float | None]] = {
        f"native sum_squares, {isa}": (lambda isa=isa: sum(sum_squares(p, isa=isa) for p in pieces))
        for isa in available_isas()}
    rows["torch float32 vector_norm"] = lambda: sum(
        float(torch.linalg.vector_norm(p, dtype=torch.float32)) ** 2 for p in pieces)

    def old_check() -> None:
        for p in pieces:
            float(p.sum(dtype=torch.float32))
    rows["torch float32 sum (the old check)"] = old_check
    rows["memory: memcpy, 1 thread"] = lambda: np.copyto(dst, src)

    results = {name: fn() for name, fn in rows.items()}  # also the untimed pass of each
    cpu: dict[str, list[float]] = {name: [] for name in rows}

    def with_cpu(name: str, fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            start = time.process_time()
            fn()
            cpu[name].append(time.process_time() - start)
        return run
    wall = time_in_turns({name: with_cpu(name, fn) for name, fn in rows.items()}, args.rounds,
                         warmup=0)

    print(f"{len(pieces)} pieces, {sum(p.numel() for p in pieces) / 1e6:.1f} M {args.dtype} "
          f"elements ({nbytes / 1e9:.3f} GB), torch threads {torch.get_num_threads()}, "
          f"{args.rounds} rounds in turns; medians")
    for name in rows:
        seconds, cpu_seconds = statistics.median(wall[name]), statistics.median(cpu[name])
        moved = 2 * nbytes if name.startswith("memory") else nbytes
        value = results[name]
        error = "" if value is None else f"  rel error {abs(value - exact) / exact:.1e}"
        print(f"{name:>36}: {seconds:.4f} s  CPU {cpu_seconds:.4f} s  "
              f"{moved / seconds / 1e9:6.2f} GB/s{error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
