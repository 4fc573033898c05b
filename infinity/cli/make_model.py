"""infinity-make-model: write a randomly initialised Llama of any size as a Hugging Face
directory (config.json, safetensors shards, byte-level tokenizer), to benchmark or try
infinity-train on a model larger than RAM when no real weights are at hand.

    infinity-make-model /tmp/llama-1.5b --layers 32 --hidden 2048 --intermediate 5632 \\
        --heads 32 --kv-heads 4 --vocab 32000                   # 1.54 B parameters, 3.1 GB bf16
    infinity-train --model /tmp/llama-1.5b --data corpus.txt --seq-len 64 --batch-size 1

The weights are written tensor by tensor (memory: one tensor), normal(0, 0.02) for matrices
and embeddings, ones for norms, seeded. The tokenizer has one token per byte plus <s> (256),
</s> (257) and <pad> (258), so --vocab is at least 259 (a larger vocab only costs parameters).
DIR must not exist; it appears complete or not at all. Exit codes: 0 done, 2 bad input.
Without an install: `python -m infinity.cli.make_model ...` from the repository root.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys

import torch

from infinity.cli.args import HelpFormatter, fail, log_to_stderr, parse_size
from infinity.models import BYTE_VOCAB_SIZE, byte_config_ids, write_random_model

PROG = "infinity-make-model"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("directory", metavar="DIR", help="the model directory to write (must not exist)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (num_hidden_layers)")
    p.add_argument("--hidden", type=int, default=256, help="hidden_size")
    p.add_argument("--intermediate", type=int, default=688, help="MLP width (intermediate_size)")
    p.add_argument("--heads", type=int, default=8,
                   help="attention heads (hidden must divide by it)")
    p.add_argument("--kv-heads", type=int, default=None,
                   help="key/value heads (GQA). Default: --heads")
    p.add_argument("--vocab", type=int, default=BYTE_VOCAB_SIZE,
                   help=f"vocabulary size (at least {BYTE_VOCAB_SIZE}, the byte tokenizer's "
                   "tokens)")
    p.add_argument("--max-positions", type=int, default=2048, help="max_position_embeddings")
    p.add_argument("--tie", action="store_true", help="tie the output head to the embedding")
    p.add_argument("--dtype", choices=DTYPES, default="bf16", help="dtype of the stored weights")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    p.add_argument("--max-shard-size", type=parse_size, default="2G",
                   help="largest safetensors shard")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress (INFO)")
    return p


def llama_config(args: argparse.Namespace):
    """The LlamaConfig the options describe; ValueError naming the option that cannot work."""
    import transformers

    for option, value in (("--layers", args.layers), ("--hidden", args.hidden),
                          ("--intermediate", args.intermediate), ("--heads", args.heads),
                          ("--max-positions", args.max_positions)):
        if value < 1:
            raise ValueError(f"{option} {value}: must be at least 1")
    kv_heads = args.kv_heads or args.heads
    if args.hidden % args.heads or args.heads % kv_heads:
        raise ValueError(f"--hidden {args.hidden}, --heads {args.heads}, --kv-heads {kv_heads}: "
                         "hidden must divide by heads, and heads by kv-heads")
    if args.vocab < BYTE_VOCAB_SIZE:
        raise ValueError(f"--vocab {args.vocab}: at least {BYTE_VOCAB_SIZE} (the byte tokenizer's "
                         "tokens, <pad> included)")
    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=kv_heads,
        max_position_embeddings=args.max_positions, tie_word_embeddings=args.tie,
        **byte_config_ids())


def _count(n: int, units: tuple[str, str, str] = ("B", "M", "K")) -> str:
    """1.54 B, 12.3 M, 45.6 K: three significant figures in the (decimal) unit that fits."""
    for unit, size in zip(units, (1e9, 1e6, 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return str(n)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_to_stderr(args.verbose)
    try:
        config = llama_config(args)
        count = write_random_model(args.directory, config, dtype=DTYPES[args.dtype], seed=args.seed,
                                   max_shard_bytes=args.max_shard_size)
    except ValueError as e:
        return fail(PROG, str(e))
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOSPC, errno.EACCES, errno.EROFS, errno.ENOENT):
            raise
        return fail(PROG, f"{args.directory}: {e.strerror or e}")
    size = sum(os.path.getsize(os.path.join(args.directory, f)) for f in os.listdir(args.directory))
    print(f"{args.directory}: Llama of {_count(count)} parameters ({count}), "
          f"{_count(size, ('GB', 'MB', 'KB'))} on disk")
    return 0


if __name__ == "__main__":
    sys.exit(main())
