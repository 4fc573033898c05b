"""infinity-convert: turn an Infinity or DeepSpeed checkpoint into Hugging Face, safetensors,
torch, zarr or Infinity format, tensor by tensor, with memory bounded by --max-shard-size.

    infinity-convert runs/llama/ out/llama-hf --to hf --dtype bf16   # from_pretrained loads it
    infinity-convert ds_ckpt/ out/llama-hf --to hf --model-config hf/llama/   # DeepSpeed -> HF
    infinity-convert ds_ckpt/ out/st --to safetensors --max-shard-size 2G --tag global_step500
    infinity-convert ds_ckpt/ runs/resumed --to infinity   # weights and Adam moments, resumable
    infinity-convert runs/llama/ out/llama.zarr --to zarr  # one zarr v3 array per tensor

SRC is a run directory (its `latest` file names the tag; --tag picks another) or a tag
directory. DeepSpeed checkpoints of ZeRO stages 1-3 on any number of ranks are read without
DeepSpeed, a GPU or a process group. The output is written under a temporary name beside DST,
read back and checked against the source (shapes, dtypes, CRC-32C of every tensor), then renamed
to DST; on any error nothing is left. Sizes are binary (2G = 2 GiB). Exit codes: 0 done, 2 bad
input (not a checkpoint, a missing or truncated file, unknown format version, DST exists).
Without an install: `python -m infinity.cli.convert ...` from the repository root.
"""

from __future__ import annotations

import argparse
import sys

import torch
from tqdm import tqdm

from infinity.checkpoint import FORMATS, Conversion
from infinity.cli.args import HelpFormatter, fail, log_to_stderr, parse_size
from infinity.errors import CheckpointError
from infinity.memory import set_mmap_threshold

PROG = "infinity-convert"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("src", metavar="SRC", help="Infinity or DeepSpeed checkpoint directory")
    p.add_argument("dst", metavar="DST", help="output directory (must not exist)")
    p.add_argument("--to", required=True, choices=FORMATS,
                   help="output format (required)%(default).0s")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="cast floating-point model weights to this; "
                        "%(default)s keeps them as stored")
    p.add_argument("--max-shard-size", type=parse_size, default="5G",
                   help="largest shard file of hf/safetensors/torch outputs; bounds peak memory")
    p.add_argument("--tag", default=None,
                   help="checkpoint tag inside SRC; %(default)s: the one SRC/latest names")
    p.add_argument("--model-config", metavar="DIR", default=None,
                   help="directory with config.json (and generation_config.json) for --to hf; "
                        "%(default)s: the checkpoint's own, or config.json beside it")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the library does")
    return p


def _summary(result) -> str:
    width = max([len("file")] + [len(f.name) for f in result.files])
    lines = [f"{'file':<{width}}  {'tensors':>7}  {'MiB':>10}"]
    lines += [f"{f.name:<{width}}  {f.tensors:>7}  {f.nbytes / 2**20:>10.2f}" for f in result.files]
    lines.append(f"{result.format} at {result.destination}: {result.tensors} tensors, "
                 f"{result.nbytes / 2**20:.2f} MiB, verified against the source "
                 "(shape, dtype, CRC-32C)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: usage errors and --help
        return int(exc.code or 0)
    log_to_stderr(args.verbose)
    set_mmap_threshold(1 << 20)  # freed tensors go back to the OS: infinity/memory/malloc.py
    try:
        conversion = Conversion(args.src, to=args.to, tag=args.tag, dtype=DTYPES.get(args.dtype),
                                max_shard_nbytes=args.max_shard_size,
                                model_config=args.model_config)
        with tqdm(total=2 * conversion.total_nbytes, unit="B", unit_scale=True, desc="write+verify",
                  disable=None) as bar:
            result = conversion.run(args.dst, on_progress=bar.update)
    except (CheckpointError, OSError) as exc:
        return fail(PROG, str(exc))
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; no output left", file=sys.stderr)
        return 130
    print(_summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
