"""Peak memory and speed of infinity.models.load on a generated Llama-shaped checkpoint.

Example (from the repository root; the default is TinyLlama's shape, a 2.1 GB bf16 checkpoint):

    python -m tools.bench_load --path /tmp --window 256M --host-budget 800M

The checkpoint is written tensor by tensor with safetensors (random bf16 values, one shard per
layer) into a fresh directory under --path, removed at the end. A child process then reports its
peak RSS (VmHWM) after it imports and builds the model on meta (the baseline) and after it loads
it into NVMe (parameters and optimizer state offloaded, bf16). The growth over the baseline is
the window plus the store's host tier (docs/scale.md). One run each; the disk and page cache are
shared with whatever else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

from infinity.cli.args import parse_size

TINYLLAMA = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
             "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4}

_CHILD = """
import json, sys, time
import torch, infinity, infinity.memory
from infinity.models import build_on_meta
directory, nvme, what, window, budget, sub_group = sys.argv[1:7]
config = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": what == "load-bf16"},
          "zero_optimization": {"stage": 3, "sub_group_size": int(sub_group),
                                "offload_param": {"device": "nvme", "nvme_path": nvme},
                                "offload_optimizer": {"device": "nvme", "nvme_path": nvme}},
          "infinity": {"host_memory_budget": int(budget)}}
build_on_meta(directory, torch.float32)  # the baseline: everything imported, the model on meta
meta_peak, meta_parts = infinity.memory.peak_rss_bytes(), infinity.memory.rss_parts()
start = time.perf_counter()
placed = infinity.models.load(directory, config, window=int(window)).infinity_placed
print(json.dumps({"stored": sum(u.nbytes for u in placed.layout.units),
                  "host_tier": placed.store.budgets[infinity.store.Tier.HOST],
                  "seconds": time.perf_counter() - start, "meta_peak": meta_peak,
                  "peak": infinity.memory.peak_rss_bytes(),
                  "rss_parts": {"meta": meta_parts, "loaded": infinity.memory.rss_parts()}}))
"""


def write_checkpoint(directory: str, shape: dict[str, int], seed: int = 0) -> int:
    """A bf16 Llama checkpoint of `shape` (untied embeddings) with its config.json and index,
    written one shard at a time (never the whole model in memory); returns the tensor bytes."""
    import safetensors.torch
    import torch
    import transformers

    os.makedirs(directory)
    transformers.LlamaConfig(**shape, tie_word_embeddings=False).save_pretrained(directory)
    h, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    shards = {"embed.safetensors": {"model.embed_tokens.weight": (v, h), "lm_head.weight": (v, h),
                                    "model.norm.weight": (h,)}}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shards[f"layer{i}.safetensors"] = {
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    g = torch.Generator().manual_seed(seed)
    weight_map, total = {}, 0
    for file, tensors in shards.items():
        values = {n: torch.randn(s, generator=g).to(torch.bfloat16) for n, s in tensors.items()}
        safetensors.torch.save_file(values, os.path.join(directory, file))
        total += sum(t.numel() * 2 for t in values.values())
        weight_map.update(dict.fromkeys(tensors, file))
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as out:
        json.dump({"metadata": {}, "weight_map": weight_map}, out)
    return total


def run_child(directory: str, nvme: str, what: str, *, window: int, host_budget: int,
              sub_group_size: int = 1 << 22) -> dict:
    """A child that builds the model on meta, then loads it ("load": fp32 parameters,
    "load-bf16": bf16): its peak RSS after building ("meta_peak") and after loading ("peak"),
    the stored bytes, the host tier, the load's seconds and what its resident set was made of
    at both points ("rss_parts": `infinity.memory.rss_parts`)."""
    argv = [directory, nvme, what, str(window), str(host_budget), str(sub_group_size)]
    out = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True,
                         timeout=1800,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if out.returncode != 0:
        raise RuntimeError(f"the {what} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", default=tempfile.gettempdir(),
                        help="scratch directory (checkpoint, swap file)")
    parser.add_argument("--window", type=parse_size, default=256 << 20)
    parser.add_argument("--host-budget", type=parse_size, default=800 << 20,
                        help="infinity.host_memory_budget")
    parser.add_argument("--layers", type=int, default=TINYLLAMA["num_hidden_layers"])
    parser.add_argument("--hidden", type=int, default=TINYLLAMA["hidden_size"])
    parser.add_argument("--intermediate", type=int, default=TINYLLAMA["intermediate_size"])
    parser.add_argument("--vocab", type=int, default=TINYLLAMA["vocab_size"])
    parser.add_argument("--sub-group-size", type=int, default=1 << 22,
                        help="optimizer tile, elements")
    args = parser.parse_args(argv)
    shape = {**TINYLLAMA, "num_hidden_layers": args.layers, "hidden_size": args.hidden,
             "intermediate_size": args.intermediate, "vocab_size": args.vocab}
    scratch = tempfile.mkdtemp(prefix="infinity-bench-load-", dir=args.path)
    try:
        checkpoint, nvme = os.path.join(scratch, "ckpt"), os.path.join(scratch, "nvme")
        os.makedirs(nvme)
        nbytes = write_checkpoint(checkpoint, shape)
        run = run_child(checkpoint, nvme, "load-bf16", window=args.window,
                        host_budget=args.host_budget, sub_group_size=args.sub_group_size)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    mib = 1 << 20
    growth = run["peak"] - run["meta_peak"]
    print(f"checkpoint {nbytes / mib:.0f} MiB bf16, window {args.window / mib:.0f} MiB, host tier "
          f"{run['host_tier'] / mib:.0f} MiB")
    print(f"peak RSS: {run['meta_peak'] / mib:.0f} MiB building on meta, "
          f"{run['peak'] / mib:.0f} MiB loading "
          f"(+{growth / mib:.0f} MiB = host tier + {(growth - run['host_tier']) / mib:.0f} MiB)")
    print(f"load {run['seconds']:.1f} s ({nbytes / run['seconds'] / 1e6:.0f} MB/s of checkpoint, "
          "build and index included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
