"""One training job, start to end: check the inputs, build the model and data, fill in the
DeepSpeed config, train (evaluating as asked), export, and leave --output complete or not at
all (infinity/train/outputs.py: [Note: nothing half-written], [Note: one run per output]).

Ctrl-C and SIGTERM finish the step in progress, save a checkpoint (with --output), export
and end as usual. A run with --save-every also saves its last step, so a run killed during
its export is finished by --resume (which then only exports).
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from infinity.engine import initialize
from infinity.errors import BudgetError, CheckpointError, ConfigError, InputError
from infinity.models import INDEX_FILE
from infinity.train import cache, checkpoints, export, models, report
from infinity.train.config import MICRO, ds_config, keep_room_for_export, take_monitors
from infinity.train.data import Batches, Rows, load_rows, pack, split_rows
from infinity.train.loop import GracefulStop, StepRecord, evaluate, perplexity, train
from infinity.train.outputs import (
    check_nvme_path,
    export_aside,
    locked_output,
    scratch_dir,
    staged_output,
)
from infinity.zero import environment_world_size

logger = logging.getLogger(__name__)

LORA_EXPORTS = ("merged", "adapter")
ADAPTER_CONFIG = "adapter_config.json"
BASE_SUBDIR = "base"  # --lora-export adapter of the built-in model: its base model, beside


@dataclass
class TrainOptions:
    """The job's inputs; None means "from the config file, else the default"."""

    model: str | None = None  # Hugging Face directory; None: the built-in default model
    data: str | None = None  # see infinity/train/data.py; None: the built-in corpus
    config: str | None = None  # DeepSpeed JSON; None: the shipped default (NVMe offload)
    nvme_path: str | None = None
    output: str | None = None
    steps: int = 100
    seq_len: int = 128
    batch_size: int | None = None
    lr: float | None = None
    lora: int | None = None
    lora_export: str = "merged"  # "merged": full model, adapters folded in; "adapter": peft's
    report: bool = False
    seed: int = 0
    max_shard_bytes: int = export.MAX_SHARD_BYTES
    save_every: int | None = None  # checkpoint every N steps into <output>/checkpoints
    resume: bool = False  # continue from the latest checkpoint in <output>/checkpoints
    host_memory: int | None = None  # infinity.host_memory_budget, bytes
    precision: str | None = None  # "bf16" / "fp32"; None: from the model and the machine
    optimizer_state: str | None = None  # Adam moments "fp32" / "bf16" / "int8"; None: config's
    no_master: bool = False  # no fp32 master (infinity.optimizer_state.master "none")
    text_field: str = "text"
    eval_data: str | None = None
    eval_split: float | None = None  # a share of --data's rows held out for evaluation
    eval_every: int | None = None  # steps between evaluations (and after the last step)
    warmup: str | None = None  # steps, or a share of --steps below 1
    schedule: str | None = None  # constant / linear / cosine
    grad_accum: int | None = None
    gradient_checkpointing: bool = False
    weight_decay: float | None = None
    clip: float | None = None
    report_to: tuple[str, ...] = ()  # "tensorboard"
    progress: bool = False  # bars on stderr for tokenizing, loading and exporting


@dataclass
class JobResult:
    records: list[StepRecord]
    peak_rss_bytes: int
    output: pathlib.Path | None
    summary: str
    interrupted: str | None  # the signal that stopped the run early ("SIGINT", "SIGTERM")
    files: list[pathlib.Path] = field(default_factory=list)
    checkpoint: pathlib.Path | None = None  # the last one this run saved
    notes: list[str] = field(default_factory=list)  # what the user should know about the output


@dataclass
class Data:
    train: Rows
    eval: Rows | None
    to_cache: dict[str, Rows]  # cache key -> rows tokenized by this run


def _check_options(options: TrainOptions) -> None:
    """What is wrong with the options alone, before anything is read or written."""
    world = environment_world_size()
    if world > 1:  # under torchrun each rank would run the whole job
        raise InputError(f"{world} ranks (WORLD_SIZE): infinity-train trains in one process (each "
                         "rank would run the whole job into the same --output); for several "
                         "ranks, call infinity.initialize from a script under torchrun "
                         "(docs/scale.md, Ranks)")
    for flag, value in (("--steps", options.steps), ("--save-every", options.save_every),
                        ("--eval-every", options.eval_every)):
        if value is not None and value < 1:
            raise InputError(f"{flag} {value}: must be at least 1")
    if options.lora_export not in LORA_EXPORTS:
        raise InputError(f"--lora-export {options.lora_export}: choose one of "
                         f"{', '.join(LORA_EXPORTS)}")
    if options.eval_data is not None and options.eval_split is not None:
        raise InputError("--eval-data and --eval-split: give one (evaluation rows from another "
                         "file, or a share of --data's)")
    if options.eval_every is not None and options.eval_data is None and options.eval_split is None:
        raise InputError("--eval-every needs --eval-data or --eval-split")
    for reporter in options.report_to:
        if reporter not in report.REPORTERS:
            raise InputError(f"--report-to {reporter}: choose from {', '.join(report.REPORTERS)}")
    if options.output is None:
        for flag, given in (("--save-every", options.save_every is not None),
                            ("--resume", options.resume), ("--report", options.report),
                            ("--report-to", bool(options.report_to))):
            if given:
                raise InputError(f"{flag} needs --output (it writes there)")
    check_nvme_path(options.nvme_path, options.output)


def _export_done(output: pathlib.Path, options: TrainOptions) -> bool:
    adapter = options.lora is not None and options.lora_export == "adapter"
    return (output / (ADAPTER_CONFIG if adapter else INDEX_FILE)).is_file()


def _resume_point(options: TrainOptions) -> checkpoints.ResumePoint | None:
    """The checkpoint to resume from, if asked. One whose step is --steps resumes only to
    export, when the export is missing (a run killed while exporting)."""
    if not options.resume:
        return None
    point = checkpoints.find_resume_point(options.output)
    if point.step >= options.steps and (point.step > options.steps
                                        or _export_done(pathlib.Path(options.output), options)):
        raise InputError(f"--resume: the checkpoint is at step {point.step}, --steps "
                         f"{options.steps} leaves nothing to do")
    return point


def _model_and_tokenizer(options: TrainOptions) -> tuple[torch.nn.Module | None, Any]:
    """(the default model, or None for --model, loaded later; the tokenizer), and --seq-len
    checked against the model's positions."""
    if options.model is None:
        model, tokenizer = models.default_model(options.seed)
        positions = models.max_positions(model)
    else:
        model, tokenizer = None, models.load_tokenizer(options.model)
        positions = models.config_positions(options.model)
    if options.seq_len < 2 or (positions is not None and options.seq_len > positions):
        raise InputError(f"--seq-len {options.seq_len}: must be between 2 and the model's "
                         f"{positions} positions" if positions else
                         f"--seq-len {options.seq_len}: must be at least 2")
    return model, tokenizer


def _rows(spec: str | None, tokenizer: Any, options: TrainOptions,
          run_dir: pathlib.Path | None, to_cache: dict[str, Rows]) -> Rows:
    """The packed rows of `spec` (None: the built-in corpus), from the run's cache when it has
    them (a --resume), else tokenized (and noted in `to_cache`)."""
    if spec is None:
        text = (models.DEFAULTS / "corpus.txt").read_text()
        fingerprint: Any = ["built-in corpus", cache.text_hash(text)]
    else:
        fingerprint = cache.data_fingerprint(spec)
    key = cache.key(fingerprint, tokenizer, options.seq_len, options.text_field)
    rows = cache.load(run_dir, key, options.seq_len) if run_dir is not None else None
    if rows is None:
        rows = pack(iter([text]), tokenizer, options.seq_len, source="<built-in corpus>") \
            if spec is None else load_rows(spec, tokenizer, options.seq_len,
                                           text_field=options.text_field,
                                           progress=options.progress)
        to_cache[key] = rows
    return rows


def _data(options: TrainOptions, tokenizer: Any, run_dir: pathlib.Path | None) -> Data:
    to_cache: dict[str, Rows] = {}
    rows = _rows(options.data, tokenizer, options, run_dir, to_cache)
    held = None
    if options.eval_split is not None:
        rows, held = split_rows(rows, options.eval_split, options.seed)
    elif options.eval_data is not None:
        held = _rows(options.eval_data, tokenizer, options, run_dir, to_cache)
    return Data(rows, held, to_cache)


def _placed_model(options: TrainOptions, model: torch.nn.Module | None,
                  config: dict[str, Any]) -> torch.nn.Module:
    """The model ready for `initialize(model, config)`: --model streamed into the store (with
    its LoRA adapters), or the default model (wrapped with LoRA when asked)."""
    if model is not None:
        model = model if options.lora is None else models.add_lora(model, options.lora)
    else:
        torch.manual_seed(options.seed)  # the LoRA adapters' initial values: a run repeats
        try:
            model = models.load_model(options.model, config, lora=options.lora,
                                      progress=options.progress)
        except (ConfigError, BudgetError) as e:  # ConfigPathError included: a bad --nvme-path
            raise InputError(_budget_hint(e)) from None
    if options.gradient_checkpointing:
        models.enable_gradient_checkpointing(model)
    return model


def _budget_hint(error: Exception) -> str:
    text = str(error)
    if isinstance(error, BudgetError) and "infinity.host_memory_budget" in text:
        text += " (infinity-train: --host-memory SIZE)"
    return text


def _restore(engine, batches: Batches, point: checkpoints.ResumePoint) -> None:
    try:
        engine.load_checkpoint(point.directory, point.tag)
    except CheckpointError as e:
        raise InputError(f"--resume: {e}") from None
    batches.seek(point.data["epoch"], point.data["next"])
    logger.info("resumed from %s at step %d", point.directory / point.tag, point.step)


def _monitor_writers(options: TrainOptions, monitors: dict[str, dict[str, Any]],
                     run_dir: pathlib.Path | None) -> list[Any]:
    """Metric writers of --report-to and of the config's enabled sections (tensorboard is
    honoured when installed; the others are warned about)."""
    wanted = set(options.report_to)
    for name in monitors:
        if name == "tensorboard" and run_dir is not None:
            wanted.add(name)
        else:
            logger.warning("config: %s.enabled is not honoured by infinity-train (metrics go to "
                           "OUTPUT/metrics.jsonl%s)", name,
                           "" if run_dir is None else "; --report-to tensorboard for TensorBoard")
    writers = []
    if "tensorboard" in wanted:
        try:
            writers.append(report.tensorboard_writer(run_dir / "tensorboard"))
        except InputError:
            if "tensorboard" in options.report_to:
                raise
            logger.warning("config: tensorboard.enabled is not honoured: the tensorboard package "
                           "is not installed (pip install tensorboard)")
    return writers


def run(options: TrainOptions, on_step: Callable[[StepRecord], None] = lambda record: None
        ) -> JobResult:
    """Train as `options` say; InputError (before anything is written to --output) for input
    that cannot work. SIGINT / SIGTERM finish the current step, save a checkpoint (with
    --output), then the job ends normally."""
    _check_options(options)
    try:
        return _run(options, on_step)
    except _StoppedEarly as stopped:
        return JobResult([], 0, None, "stopped before the first step: nothing written",
                         stopped.by)


class _StoppedEarly(Exception):
    """A signal came before the first step: the run ends with nothing written."""

    def __init__(self, by: str | None) -> None:
        super().__init__(by)
        self.by = by


def _run(options: TrainOptions, on_step: Callable[[StepRecord], None]) -> JobResult:
    with GracefulStop() as stop, locked_output(options.output), contextlib.ExitStack() as stack:
        point = _resume_point(options)
        model, tokenizer = _model_and_tokenizer(options)
        data = _data(options, tokenizer, pathlib.Path(options.output) if point else None)
        nvme_dir = stack.enter_context(scratch_dir(options.nvme_path))
        out = stack.enter_context(staged_output(options.output, resume=point is not None))
        config = ds_config(options, nvme_dir)
        if out is not None:
            keep_room_for_export(config, out.path, export.export_nbytes(options.model, model))
        writers = _monitor_writers(options, take_monitors(config), out and out.path)
        for writer in writers:
            stack.callback(writer.close)
        batches = Batches(data.train, config[MICRO], seed=options.seed)
        if point is not None:
            checkpoints.check_same_data(point, checkpoints.data_state(batches, options.seq_len))
        model = _placed_model(options, model, config)
        try:
            engine = initialize(model, config)
        except (ConfigError, BudgetError) as e:  # ConfigPathError: a bad --nvme-path
            raise InputError(_budget_hint(e)) from None
        try:
            return _train_and_export(options, engine, batches, data, point, out, stop, tokenizer,
                                     writers, on_step)
        finally:
            engine.close(restore_params=False)


def _train_and_export(options: TrainOptions, engine, batches: Batches, data: Data,
                      point: checkpoints.ResumePoint | None, out, stop: GracefulStop,
                      tokenizer: Any, writers: list[Any],
                      on_step: Callable[[StepRecord], None]) -> JobResult:
    metrics = None
    saver = checkpoints.Saver(out.final, options.seq_len) if out else None
    try:
        if point is not None:
            _restore(engine, batches, point)
            checkpoints.trim_metrics(out.path / "metrics.jsonl", point.step)
        if out is not None:
            for key, rows in data.to_cache.items():
                cache.save(out.path, key, rows)
            metrics = report.MetricsFile(out.path / "metrics.jsonl")

        def save(step: int) -> None:
            out.publish()  # the checkpoint must outlive a crash: [Note: nothing half-written]
            saver.save(engine, batches, step)

        def step_done(record: StepRecord) -> None:
            every = options.eval_every
            if data.eval is not None and (every and record.step % every == 0 or stop.requested
                                          or record.step == options.steps):
                record.eval_loss, _ = evaluate(engine, data.eval, batches.batch_size)
                record.eval_perplexity = perplexity(record.eval_loss)
            if metrics is not None:
                metrics.write(record)
            for writer in writers:
                report.write_scalars(writer, record)
            if saver is not None and options.save_every and record.step % options.save_every == 0:
                save(record.step)
            on_step(record)

        records = train(engine, batches, steps=options.steps, on_step=step_done, stop=stop,
                        first_step=point.step + 1 if point else 1)
        if stop.requested and not records:
            raise _StoppedEarly(stop.by)
        if saver is not None and records and (stop.requested or options.save_every):
            save(records[-1].step)  # the run's end is a checkpoint: --resume goes on from it
    finally:
        if metrics is not None:
            metrics.close()
    peak = engine.stats()["peak_rss_bytes"]
    files, notes = [], []
    if out is not None:
        if options.report and records:
            budgets = {t: s.budget_nbytes for t, s in engine.stats()["store"]["tiers"].items()}
            report.plot(report.read_history(out.path / "metrics.jsonl"), out.path / "report.png",
                        budgets=budgets)
            report.write_step_trace(engine, out.path / "trace.json", records[-1])
        files, notes = _export(options, engine, out, tokenizer)
    text = report.summary(records, peak_rss_bytes=peak, requested_steps=options.steps) \
        if records else f"training was done at step {point.step}: only the export ran" \
        if point is not None else "no step ran"
    output = out.final if out is not None else None
    return JobResult(records, peak, output, text, stop.by,
                     [output / f.name for f in files] if output else [],
                     saver.last_path if saver else None, notes)


def _export(options: TrainOptions, engine, out, tokenizer: Any
            ) -> tuple[list[pathlib.Path], list[str]]:
    """Write the model (or the adapter) into the run directory aside, then into place."""
    adapter = options.lora is not None and options.lora_export == "adapter"
    notes = []
    with export_aside(out.path, ADAPTER_CONFIG if adapter else INDEX_FILE) as aside:
        if not adapter:
            files = export.write_hf(engine, aside, tokenizer=tokenizer,
                                    max_shard_bytes=options.max_shard_bytes,
                                    progress=options.progress)
        else:
            base = None
            if options.model is None:  # the built-in base exists nowhere else: write it beside
                base = str((out.final / BASE_SUBDIR).resolve())
                export.write_hf(engine, aside / BASE_SUBDIR, tokenizer=tokenizer, merge=False,
                                progress=options.progress)
                notes.append(f"the adapter's base is the built-in model (seed {options.seed}), "
                             f"written to {base}: PeftModel.from_pretrained("
                             "AutoModelForCausalLM.from_pretrained(base), output) loads both")
            files = export.write_adapter(engine, aside, tokenizer=tokenizer, base=base)
    return files, notes
