"""The compute floor of one training step of a Hugging Face model directory: what its
forward + backward costs in plain PyTorch, with nothing offloaded, on this machine.

    python -m tools.bench_compute --model /tmp/llama-1.5b --seq-len 64 --batch-size 1

A model larger than RAM cannot run whole in plain PyTorch, so the same config is built with
one and with two decoder layers (random values, in RAM, in the dtype the engine computes in
for `--dtype`), forward + backward of each is timed (median of `--repeat` after one warm-up),
and the step is extrapolated: t(1) + (layers - 1) * (t(2) - t(1)). The optimizer is not in it
(its cost is bytes moved, the I/O floor). Prints the floor and the matmul GFLOP/s it implies
(6 * parameters * tokens FLOP per step).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_compute", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory (only config.json is read)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="compute dtype (the engine's choice)")
    p.add_argument("--repeat", type=int, default=5, help="timed forward+backward passes per depth")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    return p


def pass_seconds(config, layers: int, ids: torch.Tensor, dtype: torch.dtype, repeat: int) -> float:
    """Median seconds of forward + backward of `config` cut to `layers` decoder layers."""
    import transformers

    config = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": layers})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    times = []
    for i in range(repeat + 1):
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if i:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    return statistics.median(times)


def measure(directory: str, seq_len: int, batch_size: int, dtype: torch.dtype, repeat: int) -> dict:
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len), generator=torch.Generator().manual_seed(0))
    one = pass_seconds(config, 1, ids, dtype, repeat)
    two = pass_seconds(config, 2, ids, dtype, repeat)
    layers = config.num_hidden_layers
    floor = one + (layers - 1) * max(two - one, 0.0)
    with torch.device("meta"):
        params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    flop = 6 * params * batch_size * seq_len
    return {"layers": layers, "parameters": params, "one_layer_s": one, "two_layers_s": two,
            "floor_s": floor, "flop": flop, "gflops": flop / floor / 1e9, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = measure(args.model, args.seq_len, args.batch_size, DTYPES[args.dtype], args.repeat)
    print(f"{args.model}: {result['parameters'] / 1e9:.3f} B parameters, {result['layers']} layers, "
          f"{args.batch_size} x {args.seq_len} tokens, {args.dtype}, {result['threads']} threads")
    print(f"forward+backward: 1 layer {result['one_layer_s']:.3f} s, 2 layers {result['two_layers_s']:.3f} s "
          f"-> compute floor {result['floor_s']:.2f} s per step ({result['gflops']:.0f} GFLOP/s at "
          f"6 N tokens)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
