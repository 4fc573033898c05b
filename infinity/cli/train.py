"""infinity-train: fine-tune a causal language model with parameters and optimizer state
offloaded to NVMe, watch it train, and get a Hugging Face model out.

    infinity-train                                  # built-in default: small Llama, built-in corpus
    infinity-train --steps 200 --output run1 --report
    infinity-train --model ./llama-1b --data corpus/ --config ds_config.json \\
        --nvme-path /mnt/nvme --output out --steps 500 --seq-len 1024 --batch-size 4 --lr 1e-4
    infinity-train --model ./llama-1b --data chat.jsonl --lora 16 --output out-lora

Without --model it trains a small Llama-style model (a config shipped in the package, random
init, byte-level tokens) on a built-in corpus of generated English-like sentences, with
parameters and optimizer on NVMe in a temporary directory removed at the end.

--model DIR is a local Hugging Face directory (safetensors weights), streamed into the
engine's store with infinity.models.load: it never exists whole in RAM, so a model larger
than memory trains (`infinity-make-model` writes a random one of any size to try it).
Its tokenizer is read from DIR (local files only). --data is a .txt file (one document), a
.jsonl file (one document per line, its "text" field), or a directory of them; the text is
packed into rows of --seq-len tokens, shuffled with a fixed seed.

Options given here override the --config file (DeepSpeed JSON). Exit codes: 0 done (also
after Ctrl-C, which finishes the current step, saves a checkpoint when --output is set, and
exports; a second Ctrl-C aborts), 2 bad input (one line on stderr; nothing is left in
--output), 1 any other failure. `infinity-train ... --output DIR --resume` continues a run.
Without an install: `python -m infinity.cli.train ...` from the repository root.
"""

from __future__ import annotations

import argparse
import errno
import sys

from tqdm import tqdm

from infinity.cli.args import HelpFormatter, fail, log_to_stderr, parse_size
from infinity.errors import InputError
from infinity.train import TrainOptions, run
from infinity.train.job import DEFAULT_BATCH_SIZE, LORA_EXPORTS
from infinity.train.loop import StepRecord

PROG = "infinity-train"


class _Formatter(HelpFormatter):
    """Defaults on every option that has a value (the others say theirs in words); the module
    docstring (with its examples) kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=_Formatter)
    d = TrainOptions()
    p.add_argument("--model", metavar="DIR", help="local Hugging Face model directory (config.json, "
                   "safetensors weights, tokenizer), streamed into the store with infinity.models.load "
                   "(never whole in RAM). Default: the built-in small Llama with byte-level tokens")
    p.add_argument("--data", metavar="FILE|DIR", help=".txt, .jsonl (\"text\" field) or a directory "
                   "of them. Default: the built-in corpus")
    p.add_argument("--config", metavar="JSON", help="DeepSpeed config file; the options below "
                   "override it. Default: the shipped one (ZeRO-3, params and optimizer on NVMe)")
    p.add_argument("--nvme-path", metavar="DIR", help="where offloaded params and optimizer state go "
                   "(a temporary directory inside it, removed at the end). Default: the config's "
                   "nvme_path, else the system temporary directory")
    p.add_argument("--output", metavar="DIR", help="metrics.jsonl, the exported model (safetensors "
                   "shards + index + config + tokenizer) and the --report files; must not exist "
                   "or be empty. Default: nothing is written")
    p.add_argument("--steps", type=int, metavar="N", default=d.steps, help="optimizer steps")
    p.add_argument("--seq-len", type=int, metavar="N", default=d.seq_len, help="tokens per packed sequence "
                   "(at most the model's max_position_embeddings)")
    p.add_argument("--batch-size", type=int, metavar="N", help="sequences per micro-batch "
                   f"(train_micro_batch_size_per_gpu). Default: the config's, else {DEFAULT_BATCH_SIZE}")
    p.add_argument("--lr", type=float, metavar="X", help="learning rate (optimizer.params.lr). Default: the "
                   "config's (3e-3 in the shipped one)")
    p.add_argument("--lora", type=int, metavar="R", help="train only LoRA adapters of rank R "
                   "(alpha 2R) on the attention and MLP projections (needs peft); see --lora-export. "
                   "Default: full fine-tuning")
    p.add_argument("--lora-export", choices=LORA_EXPORTS, default=d.lora_export, help="with --lora: "
                   "'merged' writes the full model with the adapters folded in (loads without peft), "
                   "'adapter' only the adapters in peft's layout (PeftModel.from_pretrained)")
    p.add_argument("--report", action="store_true", help="also write report.png (loss, step time, "
                   "bytes per store tier) and trace.json (Perfetto trace of the last step) to --output")
    p.add_argument("--seed", type=int, metavar="N", default=d.seed, help="shuffle (and default model init) seed")
    p.add_argument("--max-shard-size", type=parse_size, metavar="SIZE", default="2G",
                   help="largest safetensors shard of the export (bytes, K/M/G suffixes)")
    p.add_argument("--save-every", type=int, metavar="N", help="save a checkpoint every N steps "
                   "into OUTPUT/checkpoints (needs --output; from the first save on, --output exists "
                   "and holds the checkpoints). Default: only Ctrl-C saves one")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in "
                   "OUTPUT/checkpoints, with the same model, data and options; --steps is the total")
    p.add_argument("-v", "--verbose", action="store_true", help="log the engine's decisions (INFO)")
    return p


class _Progress:
    """The tqdm bar: loss, tokens/s, step time, resident memory, NVMe GB/s."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.bar: tqdm | None = None  # made at the first step: bad input shows only its line

    def __call__(self, r: StepRecord) -> None:
        if self.bar is None:
            self.bar = tqdm(total=self.steps, initial=r.step - 1, desc=PROG, unit="step",  # resumed: > 1
                            file=sys.stderr, dynamic_ncols=True)
        self.bar.set_postfix_str(f"loss {r.loss:.3f}, {r.tokens_per_s:.0f} tok/s, {r.step_s:.2f} s/step, "
                                 f"RSS {r.rss_bytes / 2**20:.0f} MiB, NVMe {r.nvme_gbps:.3f} GB/s",
                                 refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_to_stderr(args.verbose)
    options = TrainOptions(model=args.model, data=args.data, config=args.config, nvme_path=args.nvme_path,
                           output=args.output, steps=args.steps, seq_len=args.seq_len,
                           batch_size=args.batch_size, lr=args.lr, lora=args.lora,
                           lora_export=args.lora_export, report=args.report, seed=args.seed,
                           max_shard_bytes=args.max_shard_size, save_every=args.save_every,
                           resume=args.resume)
    progress = _Progress(args.steps)
    try:
        result = run(options, on_step=progress)
    except InputError as e:
        progress.close()
        return fail(PROG, str(e))
    except OSError as e:
        progress.close()
        if e.errno != errno.ENOSPC:
            raise
        return fail(PROG, f"disk full: {e}")
    except KeyboardInterrupt:
        progress.close()
        print(f"{PROG}: aborted", file=sys.stderr)
        return 130
    progress.close()
    print(result.summary)
    if result.interrupted:
        print("stopped early by Ctrl-C")
    if result.checkpoint is not None:
        print(f"last checkpoint {result.checkpoint} (continue with the same options and --resume)")
    print(f"model and metrics in {result.output}" if result.output else "no --output: nothing saved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
