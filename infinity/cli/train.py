"""infinity-train: fine-tune a causal language model with parameters and optimizer state
offloaded to NVMe, watch it train, and get a Hugging Face model out.

    infinity-train                                  # built-in default: small Llama, built-in corpus
    infinity-train --steps 200 --output run1 --report
    infinity-train --model ./llama-1b --data corpus/ --nvme-path /mnt/nvme --output out \\
        --steps 500 --seq-len 1024 --batch-size 4 --lr 1e-4 --schedule cosine --warmup 0.05
    infinity-train --model ./llama-1b --data chat.jsonl --eval-split 0.05 --eval-every 50 \\
        --lora 16 --output out-lora

Without --model it trains a small Llama-style model (a config shipped in the package, random
init, byte-level tokens) on a built-in corpus of generated English-like sentences, with
parameters and optimizer on NVMe in a temporary directory removed at the end.

--model DIR is a local Hugging Face directory (safetensors weights), streamed into the
engine's store with infinity.models.load: it never exists whole in RAM, so a model larger
than memory trains (`infinity-make-model` writes a random one of any size to try it).
Its tokenizer is read from DIR (local files only). --data is a .txt file (one document), a
.jsonl file (one example per line: its "text" field, or a chat's "messages", of which only
the assistant turns train), a directory of them, or with the datasets package
(pip install 'infinity[data]') .parquet / .json files, a save_to_disk folder or the id of a
dataset in the local cache; the text is packed into rows of --seq-len tokens, shuffled with a
fixed seed. The host memory budget is a share of the memory available (--host-memory sets
it); the engine fits its plan into it, and says the least that works when nothing fits.

Options given here override the --config file (DeepSpeed JSON). Exit codes: 0 done (also
after Ctrl-C or SIGTERM, which finish the current step, save a checkpoint when --output is
set, and export; a second one aborts), 2 bad input (one line on stderr; nothing is left in
--output), 1 any other failure. `infinity-train ... --output DIR --resume` continues a run;
one --output takes one run at a time. Without an install: `python -m infinity.cli.train ...`
from the repository root.
"""

from __future__ import annotations

import argparse
import errno
import sys

from tqdm import tqdm

from infinity.cli.args import HelpFormatter, fail, log_to_stderr, parse_size
from infinity.errors import InputError
from infinity.train import TrainOptions, run
from infinity.train.config import DEFAULT_BATCH_SIZE, SCHEDULES
from infinity.train.job import LORA_EXPORTS
from infinity.train.loop import StepRecord
from infinity.train.report import REPORTERS

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
    p.add_argument("--model", metavar="DIR", help="local Hugging Face model directory "
                   "(config.json, safetensors weights, tokenizer), streamed into the store with "
                   "infinity.models.load (never whole in RAM). Default: the built-in small "
                   "Llama with byte-level tokens")
    p.add_argument("--data", metavar="PATH|ID", help=".txt, .jsonl (\"text\" or chat "
                   "\"messages\"), a directory of them; with datasets installed also .parquet, "
                   ".json, a save_to_disk folder or a cached dataset id. Default: the built-in "
                   "corpus")
    p.add_argument("--text-field", metavar="NAME", default=d.text_field,
                   help="the field (column) holding a document's text")
    p.add_argument("--config", metavar="JSON", help="DeepSpeed config file; the options below "
                   "override it. Default: the shipped one (ZeRO-3, params and optimizer on NVMe)")
    p.add_argument("--nvme-path", metavar="DIR", help="where offloaded params and optimizer "
                   "state go (a temporary directory inside it, removed at the end; not inside "
                   "--output). Default: the config's nvme_path, else the system temporary "
                   "directory")
    p.add_argument("--host-memory", metavar="SIZE", type=parse_size,
                   help="host memory the engine may use (infinity.host_memory_budget: 2G is "
                   "2 GiB, 2GB 2e9 bytes). Default: the config's; the shipped one's is \"auto\", "
                   "80%% of the memory available at start")
    p.add_argument("--output", metavar="DIR", help="metrics.jsonl, the exported model "
                   "(safetensors shards + index + config + tokenizer) and the --report files; "
                   "must not exist or be empty. Default: nothing is written")
    p.add_argument("--steps", type=int, metavar="N", default=d.steps, help="optimizer steps")
    p.add_argument("--seq-len", type=int, metavar="N", default=d.seq_len,
                   help="tokens per packed sequence (at most the model's max_position_embeddings)")
    p.add_argument("--batch-size", type=int, metavar="N", help="sequences per micro-batch "
                   f"(train_micro_batch_size_per_gpu). Default: the config's, else "
                   f"{DEFAULT_BATCH_SIZE}")
    p.add_argument("--grad-accum", type=int, metavar="N", help="micro-batches per optimizer "
                   "step (gradient_accumulation_steps). Default: the config's, else 1")
    p.add_argument("--lr", type=float, metavar="X", help="learning rate (optimizer.params.lr). "
                   "Default: the config's (3e-3 in the shipped one)")
    p.add_argument("--schedule", choices=SCHEDULES, help="learning-rate schedule after the "
                   "warmup: constant, linear decay to 0 or cosine decay over --steps. Default: "
                   "the config's scheduler (none in the shipped one: constant)")
    p.add_argument("--warmup", metavar="N|RATIO", help="warmup steps, or a share of --steps "
                   "below 1 (e.g. 0.05), linear from 0. Default: the config's (none)")
    p.add_argument("--weight-decay", type=float, metavar="X",
                   help="AdamW weight decay (optimizer.params.weight_decay). Default: the config's")
    p.add_argument("--clip", type=float, metavar="X", help="clip the gradient norm to X "
                   "(gradient_clipping; 0 is off). Default: the config's")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--bf16", dest="precision", action="store_const", const="bf16",
                           help="train in bf16 (bf16.enabled). Default: a bf16 model trains in "
                           "bf16 where the machine computes bf16 fast, else in fp32")
    precision.add_argument("--fp32", dest="precision", action="store_const", const="fp32",
                           help="train in fp32 (bf16 and fp16 off)")
    p.add_argument("--gradient-checkpointing", action="store_true", help="recompute "
                   "activations in backward (less memory, about a third more compute)")
    p.add_argument("--lora", type=int, metavar="R", help="train only LoRA adapters of rank R "
                   "(alpha 2R) on the attention and MLP projections (needs peft); see "
                   "--lora-export. Default: full fine-tuning")
    p.add_argument("--lora-export", choices=LORA_EXPORTS, default=d.lora_export,
                   help="with --lora: 'merged' writes the full model with the adapters folded "
                   "in (loads without peft), 'adapter' only the adapters in peft's layout "
                   "(PeftModel.from_pretrained; on the built-in model its base is written to "
                   "OUTPUT/base)")
    p.add_argument("--eval-data", metavar="PATH|ID", help="evaluation data (formats as --data)")
    p.add_argument("--eval-split", type=float, metavar="RATIO", help="hold out this share of "
                   "--data's rows for evaluation (e.g. 0.05)")
    p.add_argument("--eval-every", type=int, metavar="N", help="evaluate every N steps (loss "
                   "and perplexity on the held-out rows). Default: after the last step only")
    p.add_argument("--report", action="store_true", help="also write report.png (loss, eval "
                   "loss, lr, step time, tokens/s, NVMe GB/s, RSS, grad norm, bytes per store "
                   "tier) and trace.json (Perfetto trace of the last step) to --output")
    p.add_argument("--report-to", action="append", choices=REPORTERS, default=[],
                   help="also write the step figures there (tensorboard: OUTPUT/tensorboard, "
                   "needs the tensorboard package)")
    p.add_argument("--seed", type=int, metavar="N", default=d.seed,
                   help="shuffle (and default model init) seed")
    p.add_argument("--max-shard-size", type=parse_size, metavar="SIZE", default="2G",
                   help="largest safetensors shard of the export (2G is 2 GiB, 2GB 2e9 bytes)")
    p.add_argument("--save-every", type=int, metavar="N", help="save a checkpoint every N "
                   "steps and after the last into OUTPUT/checkpoints (needs --output; from the "
                   "first save on, --output exists and holds the checkpoints). Default: only "
                   "Ctrl-C and SIGTERM save one")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint "
                   "in OUTPUT/checkpoints, with the same model, data and options; --steps is "
                   "the total (a finished run whose export is missing only exports)")
    p.add_argument("-v", "--verbose", action="store_true", help="log the engine's decisions (INFO)")
    return p


class _Progress:
    """The tqdm bar: loss, eval loss and perplexity, tokens/s, step time, resident memory,
    NVMe GB/s."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.bar: tqdm | None = None  # made at the first step: bad input shows only its line
        self.evaluated = ""

    def __call__(self, r: StepRecord) -> None:
        if self.bar is None:
            self.bar = tqdm(total=self.steps, initial=r.step - 1, desc=PROG, unit="step",
                            file=sys.stderr, dynamic_ncols=True)  # resumed: initial > 0
        if r.eval_loss is not None:
            self.evaluated = f"eval {r.eval_loss:.3f} (ppl {r.eval_perplexity:.1f}), "
        self.bar.set_postfix_str(
            f"loss {r.loss:.3f}, {self.evaluated}{r.tokens_per_s:.0f} tok/s, "
            f"{r.step_s:.2f} s/step, RSS {r.rss_bytes / 2**20:.0f} MiB, "
            f"NVMe {r.nvme_gbps:.3f} GB/s", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def options_of(args: argparse.Namespace) -> TrainOptions:
    return TrainOptions(
        model=args.model, data=args.data, config=args.config, nvme_path=args.nvme_path,
        output=args.output, steps=args.steps, seq_len=args.seq_len, batch_size=args.batch_size,
        lr=args.lr, lora=args.lora, lora_export=args.lora_export, report=args.report,
        seed=args.seed, max_shard_bytes=args.max_shard_size, save_every=args.save_every,
        resume=args.resume, host_memory=args.host_memory, precision=args.precision,
        text_field=args.text_field, eval_data=args.eval_data, eval_split=args.eval_split,
        eval_every=args.eval_every, warmup=args.warmup, schedule=args.schedule,
        grad_accum=args.grad_accum, gradient_checkpointing=args.gradient_checkpointing,
        weight_decay=args.weight_decay, clip=args.clip, report_to=tuple(args.report_to),
        progress=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log_to_stderr(args.verbose)
    progress = _Progress(args.steps)
    try:
        result = run(options_of(args), on_step=progress)
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
    if result.interrupted and result.records:
        by = "Ctrl-C" if result.interrupted == "SIGINT" else result.interrupted
        print(f"stopped early by {by}")
    if result.checkpoint is not None:
        print(f"last checkpoint {result.checkpoint} (continue with the same options and --resume)")
    for note in result.notes:
        print(note)
    if result.output:
        print(f"model and metrics in {result.output}")
    elif not result.interrupted or result.records:
        print("no --output: nothing saved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
