"""One training job, start to end: check the inputs, build the model and data, fill in the
DeepSpeed config, train, export, and leave --output complete or not at all.

[Note: nothing half-written] Everything goes to a hidden sibling `.<output>.partial-<pid>`,
renamed to --output when the job ends well or when it saves its first checkpoint (which must
outlive a crash to be resumed: from then on the job writes in --output itself); any failure
before that removes it. All input is checked before, so bad input never leaves anything in
--output. A --resume works in --output itself. Parameter and optimizer files go to a fresh
temporary directory (under --nvme-path when given), removed at the end whatever happens.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from infinity.engine import initialize
from infinity.errors import BudgetError, CheckpointError, ConfigError, InputError
from infinity.train import checkpoints, export, models, report
from infinity.train.data import Batches, load_rows, pack
from infinity.train.loop import GracefulStop, StepRecord, train

logger = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 8
MICRO = "train_micro_batch_size_per_gpu"
LORA_EXPORTS = ("merged", "adapter")


@dataclass
class TrainOptions:
    """The job's inputs; None means "from the config file, else the default"."""

    model: str | None = None  # Hugging Face directory; None: the built-in default model
    data: str | None = None  # .txt / .jsonl / directory; None: the built-in corpus
    config: str | None = None  # DeepSpeed JSON; None: the shipped default (NVMe offload)
    nvme_path: str | None = None
    output: str | None = None
    steps: int = 100
    seq_len: int = 128
    batch_size: int | None = None
    lr: float | None = None
    lora: int | None = None
    lora_export: str = "merged"  # "merged": full model, adapters folded in; "adapter": peft adapter only
    report: bool = False
    seed: int = 0
    max_shard_bytes: int = export.MAX_SHARD_BYTES
    save_every: int | None = None  # checkpoint every N steps into <output>/checkpoints
    resume: bool = False  # continue from the latest checkpoint in <output>/checkpoints


@dataclass
class JobResult:
    records: list[StepRecord]
    peak_rss_bytes: int
    output: pathlib.Path | None
    summary: str
    interrupted: bool
    files: list[pathlib.Path] = field(default_factory=list)
    checkpoint: pathlib.Path | None = None  # the last one this run saved


def ds_config(options: TrainOptions, nvme_dir: Callable[[], str]) -> dict[str, Any]:
    """The config file (or the shipped default) with the command-line options on top; an NVMe
    offload without nvme_path gets `nvme_dir()`; --nvme-path replaces any nvme_path."""
    if options.config is None:
        config = json.loads((models.DEFAULTS / "ds_config.json").read_text())
    else:
        try:
            config = json.loads(pathlib.Path(options.config).read_text())
        except OSError as e:
            raise InputError(f"--config {options.config}: {e.strerror}") from None
        except (ValueError, RecursionError) as e:  # not JSON, or not UTF-8
            raise InputError(f"--config {options.config}: not JSON ({e})") from None
        if not isinstance(config, dict):
            raise InputError(f"--config {options.config}: not a JSON object")
    micro = config.get(MICRO, "auto")
    if options.batch_size is not None and options.batch_size < 1:
        raise InputError(f"--batch-size {options.batch_size}: must be at least 1")
    if options.batch_size is not None or micro == "auto":
        config[MICRO] = options.batch_size or DEFAULT_BATCH_SIZE
        config.pop("train_batch_size", None)  # follows from micro batch x accumulation
    elif (isinstance(micro, bool) or not isinstance(micro, int | float)
          or not float(micro).is_integer() or micro < 1):
        raise InputError(f"--config {options.config}: {MICRO} is {micro!r}; give a whole "
                         f"number >= 1 (or \"auto\")")
    else:
        config[MICRO] = int(micro)
    if options.lr is not None:
        optimizer = config.setdefault("optimizer", {"type": "AdamW", "params": {}})
        optimizer.setdefault("params", {})["lr"] = options.lr
    zero = config.setdefault("zero_optimization", {})
    for key in ("offload_param", "offload_optimizer"):
        section = zero.get(key)
        if isinstance(section, dict) and section.get("device") == "nvme":
            if options.nvme_path is not None or not section.get("nvme_path"):
                section["nvme_path"] = nvme_dir()
    return config


@contextlib.contextmanager
def scratch_dir(nvme_path: str | None) -> Iterator[Callable[[], str]]:
    """A lazily made temporary directory (under nvme_path when given), removed at the end."""
    made: list[str] = []

    def get() -> str:
        if not made:
            try:
                if nvme_path is not None:
                    os.makedirs(nvme_path, exist_ok=True)
                made.append(tempfile.mkdtemp(prefix="infinity-train-", dir=nvme_path))
            except OSError as e:
                where = f"--nvme-path {nvme_path}" if nvme_path else f"temporary directory {tempfile.gettempdir()}"
                raise InputError(f"{where}: cannot write there ({e.strerror})") from None
        return made[0]
    try:
        yield get
    finally:
        if made:
            shutil.rmtree(made[0], ignore_errors=True)


class Output:
    """Where the job's files go now: the staging directory until `publish()`, then --output."""

    def __init__(self, final: pathlib.Path, staging: pathlib.Path | None) -> None:
        self.final, self.staging = final, staging

    @property
    def path(self) -> pathlib.Path:
        return self.staging or self.final

    def publish(self) -> None:
        """Make the staging directory --output (files open in it stay valid)."""
        if self.staging is None:
            return
        if self.final.exists():
            self.final.rmdir()
        self.staging.rename(self.final)
        self.staging = None


@contextlib.contextmanager
def staged_output(output: str | None, *, resume: bool = False) -> Iterator[Output | None]:
    """See [Note: nothing half-written]."""
    if output is None:
        yield None
        return
    final = pathlib.Path(output)
    if resume:
        yield Output(final, None)
        return
    if final.exists() and not (final.is_dir() and not any(final.iterdir())):
        hint = " (it holds checkpoints: add --resume to continue)" if checkpoints.has_any(final) else ""
        raise InputError(f"--output {final}: exists and is not an empty directory{hint}")
    staging = final.parent / f".{final.name}.partial-{os.getpid()}"
    try:
        staging.mkdir(parents=True)
    except OSError as e:
        raise InputError(f"--output {final}: cannot write there ({e.strerror})") from None
    out = Output(final, staging)
    try:
        yield out
        out.publish()
    finally:
        if out.staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def _tokenizer_and_data(options: TrainOptions):
    """(the default model or None for --model, its tokenizer, the packed rows), all checked
    before the (possibly long) model load."""
    if options.model is None:
        model, tokenizer = models.default_model(options.seed)
    else:
        model = None
        tokenizer = models.load_tokenizer(options.model)
    positions = models.max_positions(model) if model is not None else _config_positions(options.model)
    if options.seq_len < 2 or (positions is not None and options.seq_len > positions):
        raise InputError(f"--seq-len {options.seq_len}: must be between 2 and the model's "
                         f"{positions} positions" if positions else f"--seq-len {options.seq_len}: must be at least 2")
    if options.data is None:
        text = (models.DEFAULTS / "corpus.txt").read_text()
        rows = pack(iter([text]), tokenizer, options.seq_len, source="<built-in corpus>")
    else:
        rows = load_rows(options.data, tokenizer, options.seq_len)
    return model, tokenizer, rows


def _placed_model(options: TrainOptions, model, config: dict[str, Any]):
    """The model ready for `initialize(model, config)`: --model streamed into the store (with
    its LoRA adapters), or the default model (wrapped with LoRA when asked)."""
    if model is not None:
        return model if options.lora is None else models.add_lora(model, options.lora)
    torch.manual_seed(options.seed)  # the LoRA adapters' initial values: a run repeats exactly
    try:
        return models.load_model(options.model, config, lora=options.lora)
    except (ConfigError, BudgetError) as e:  # ConfigPathError included: a bad --nvme-path
        raise InputError(str(e)) from None


def _restore(engine, batches: Batches, point: checkpoints.ResumePoint) -> None:
    try:
        engine.load_checkpoint(point.directory, point.tag)
    except CheckpointError as e:
        raise InputError(f"--resume: {e}") from None
    batches.seek(point.data["epoch"], point.data["next"])
    logger.info("resumed from %s at step %d", point.directory / point.tag, point.step)


def _config_positions(directory: str) -> int | None:
    path = pathlib.Path(directory) / "config.json"
    try:
        fields = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None  # load_model / load_tokenizer say what is wrong
    if not isinstance(fields, dict):
        return None
    found = (fields.get(k) for k in ("max_position_embeddings", "n_positions"))
    return next((n for n in found if isinstance(n, int) and not isinstance(n, bool) and n > 0),
                None)


def _resume_point(options: TrainOptions) -> checkpoints.ResumePoint | None:
    """Check the checkpoint options; the checkpoint to resume from, if asked."""
    if options.save_every is not None and options.save_every < 1:
        raise InputError(f"--save-every {options.save_every}: must be at least 1")
    if options.output is None:
        for flag, given in (("--save-every", options.save_every is not None), ("--resume", options.resume)):
            if given:
                raise InputError(f"{flag} needs --output (checkpoints go to <output>/{checkpoints.SUBDIR})")
        return None
    if not options.resume:
        return None
    point = checkpoints.find_resume_point(options.output)
    if point.step >= options.steps:
        raise InputError(f"--resume: the checkpoint is at step {point.step}, --steps {options.steps} "
                         f"leaves nothing to do")
    return point


def run(options: TrainOptions, on_step: Callable[[StepRecord], None] = lambda record: None) -> JobResult:
    """Train as `options` say; InputError (before anything is written to --output) for input
    that cannot work. SIGINT finishes the current step, saves a checkpoint (with --output),
    then the job ends normally."""
    if options.steps < 1:
        raise InputError(f"--steps {options.steps}: must be at least 1")
    if options.lora_export not in LORA_EXPORTS:
        raise InputError(f"--lora-export {options.lora_export}: choose one of {', '.join(LORA_EXPORTS)}")
    point = _resume_point(options)
    model, tokenizer, rows = _tokenizer_and_data(options)
    with scratch_dir(options.nvme_path) as nvme_dir, \
            staged_output(options.output, resume=point is not None) as out:
        config = ds_config(options, nvme_dir)
        batches = Batches(rows, config[MICRO], seed=options.seed)
        if point is not None:
            checkpoints.check_same_data(point, checkpoints.data_state(batches, options.seq_len))
        model = _placed_model(options, model, config)
        try:
            engine = initialize(model, config)
        except (ConfigError, BudgetError) as e:  # ConfigPathError included: a bad --nvme-path
            raise InputError(str(e)) from None
        metrics = None
        try:
            if point is not None:
                _restore(engine, batches, point)
                checkpoints.trim_metrics(out.path / "metrics.jsonl", point.step)
            metrics = report.MetricsFile(out.path / "metrics.jsonl") if out else None
            saver = checkpoints.Saver(out.final, options.seq_len) if out else None

            def save(step: int) -> None:
                out.publish()  # the checkpoint must outlive a crash: see [Note: nothing half-written]
                saver.save(engine, batches, step)

            def step_done(record: StepRecord) -> None:
                if metrics is not None:
                    metrics.write(record)
                if saver is not None and options.save_every and record.step % options.save_every == 0:
                    save(record.step)
                on_step(record)

            with GracefulStop() as stop:
                records = train(engine, batches, steps=options.steps, on_step=step_done, stop=stop,
                                first_step=point.step + 1 if point else 1)
            if stop.requested and saver is not None and records:
                save(records[-1].step)
            peak = engine.stats()["peak_rss_bytes"]
            files = []
            if out is not None:
                target = out.path
                if options.report and records:
                    report.plot(records, target / "report.png")
                    report.write_step_trace(engine, target / "trace.json", records[-1])
                if options.lora is not None and options.lora_export == "adapter":
                    files = export.write_adapter(engine, target, tokenizer=tokenizer)
                else:
                    files = export.write_hf(engine, target, tokenizer=tokenizer,
                                            max_shard_bytes=options.max_shard_bytes)
        finally:
            if metrics is not None:
                metrics.close()
            engine.close(restore_params=False)
    text = report.summary(records, peak_rss_bytes=peak, requested_steps=options.steps)
    output = pathlib.Path(options.output) if options.output else None
    return JobResult(records, peak, output, text, stop.requested,
                     [output / f.name for f in files] if output else [], saver.last_path if saver else None)
