"""The compute floor of one training step of a Hugging Face model directory: what its
forward + backward costs in plain PyTorch, with nothing offloaded, on this machine.

    python -m tools.bench_compute --model /tmp/llama-1.5b --seq-len 64 --batch-size 1

A model larger than RAM cannot run whole in plain PyTorch, so the same config is built with
two decoder layers (random values, in RAM, in the compute dtype of `--dtype`) and its
forward + backward is timed `--repeat` times after one warm-up, each decoder layer's forward
and backward timed inside the pass by module hooks. The step is extrapolated as the pass less
its two layers (embedding, head, loss) plus `layers` times the median layer. The optimizer is
not in it (its cost is bytes moved: the I/O floor). Prints the floor and the GFLOP/s it
implies (6 * parameters * tokens per step).
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
    p.add_argument("--model", required=True,
                   help="Hugging Face model directory (only config.json is read)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--dtype", choices=DTYPES, default="bf16",
                   help="compute dtype (the engine's choice)")
    p.add_argument("--repeat", type=int, default=5, help="timed forward+backward passes per depth")
    p.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    return p


class LayerClock:
    """Seconds each decoder layer spends in forward and in backward, from module hooks."""

    def __init__(self, layers: torch.nn.ModuleList) -> None:
        self.seconds = [0.0] * len(layers)
        self._started: dict[int, float] = {}
        for i, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda m, a, i=i: self._start(i))
            layer.register_forward_hook(lambda m, a, out, i=i: self._stop(i))
            layer.register_full_backward_pre_hook(lambda m, g, i=i: self._start(i))
            layer.register_full_backward_hook(lambda m, gi, go, i=i: self._stop(i))

    def _start(self, i: int) -> None:
        self._started[i] = time.perf_counter()

    def _stop(self, i: int) -> None:
        self.seconds[i] += time.perf_counter() - self._started.pop(i)


def decoder_layers(model: torch.nn.Module, count: int) -> torch.nn.ModuleList:
    """The model's ModuleList of `count` decoder layers."""
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            return module
    raise ValueError(f"{type(model).__name__}: no list of {count} decoder layers found")


def measure(directory: str, seq_len: int, batch_size: int, dtype: torch.dtype, repeat: int) -> dict:
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    layers = config.num_hidden_layers
    with torch.device("meta"):
        params = sum(p.numel()
                     for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
    small = config.__class__.from_dict({**config.to_dict(), "num_hidden_layers": 2})
    model = transformers.AutoModelForCausalLM.from_config(small, dtype=dtype)
    clock = LayerClock(decoder_layers(model, 2))
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len),
                        generator=torch.Generator().manual_seed(0))
    passes, per_layer = [], []
    for i in range(repeat + 1):
        clock.seconds = [0.0, 0.0]
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        elapsed = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        if i:  # the first pass warms up (allocations, kernels)
            passes.append(elapsed - sum(clock.seconds))
            per_layer += clock.seconds
    rest, layer = statistics.median(passes), statistics.median(per_layer)
    floor = rest + layers * layer
    flop = 6 * params * batch_size * seq_len
    return {"layers": layers, "parameters": params, "rest_s": rest, "layer_s": layer,
            "layer_s_range": [min(per_layer), max(per_layer)], "floor_s": floor,
            "floor_s_range": [min(passes) + layers * min(per_layer),
                              max(passes) + layers * max(per_layer)],
            "flop": flop,
            "gflops": flop / floor / 1e9, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = measure(args.model, args.seq_len, args.batch_size, DTYPES[args.dtype], args.repeat)
    print(f"{args.model}: {result['parameters'] / 1e9:.3f} B parameters, "
          f"{result['layers']} layers, {args.batch_size} x {args.seq_len} tokens, {args.dtype}, "
          f"{result['threads']} threads")
    low, high = result["layer_s_range"]
    print(f"forward+backward: one decoder layer {result['layer_s']:.3f} s "
          f"(median, {low:.3f}-{high:.3f}), the rest {result['rest_s']:.3f} s -> compute floor "
          f"{result['floor_s']:.2f} s per step "
          f"({result['floor_s_range'][0]:.2f}-{result['floor_s_range'][1]:.2f} from the fastest "
          f"and slowest) ({result['gflops']:.1f} GFLOP/s at 6 N tokens)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
