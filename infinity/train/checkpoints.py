"""Checkpoints of a training job (--save-every, Ctrl-C, --resume) in `<output>/checkpoints`.

A checkpoint is the engine's own (engine.save_checkpoint: weights, optimizer state, counters,
RNG states) with a client_state saying where the job was: its step and the data position
(epoch and offset into that epoch's permutation), plus what must not change across a resume
(rows, sequence length, batch size, seed), so the resumed run takes the next batch, not the
first, and continues bit-identically.
"""

from __future__ import annotations

import json
import logging
import pathlib
from dataclasses import dataclass
from typing import Any

from infinity.checkpoint import CheckpointReader, latest_tag
from infinity.engine import Engine
from infinity.errors import CheckpointError, InputError
from infinity.train.data import Batches

logger = logging.getLogger(__name__)

SUBDIR = "checkpoints"
# what the data position means only together with: a resume with other values is refused,
# naming the option that sets each (the row count follows from the data and --seq-len)
FIXED = {"seq_len": "--seq-len", "batch_size": "--batch-size", "seed": "--seed",
         "rows": "the data's row count"}


@dataclass
class ResumePoint:
    """Where a saved job stopped (read before anything is built, so bad input fails fast)."""

    directory: pathlib.Path
    tag: str
    step: int
    data: dict[str, int]


def directory(output: str | pathlib.Path) -> pathlib.Path:
    return pathlib.Path(output) / SUBDIR


def has_any(output: str | pathlib.Path) -> bool:
    try:
        return latest_tag(directory(output)) is not None
    except CheckpointError:  # a `latest` naming nothing usable: still not an empty output
        return True


def find_resume_point(output: str | pathlib.Path) -> ResumePoint:
    """The latest checkpoint in `<output>/checkpoints`; InputError when there is none or it is
    not one this job wrote."""
    where = directory(output)
    try:
        tag = latest_tag(where)
        if tag is None:
            raise InputError(f"--resume: no checkpoint in {where} (nothing to resume; run with "
                             f"--save-every N first, or without --resume)")
        state = CheckpointReader(where, tag).metadata.get("client_state") or {}
    except CheckpointError as e:
        raise InputError(f"--resume: {e}") from None
    step, data = (state.get("step"), state.get("data")) if isinstance(state, dict) else (None, None)
    if not _natural(step) or not isinstance(data, dict):
        raise InputError(f"--resume: checkpoint {where / tag} was not written by infinity-train "
                         f"(no step and data position in its client_state)")
    missing = [key for key in ("epoch", "next", *FIXED) if not _natural(data.get(key), least=-1)]
    if missing:
        raise InputError(f"--resume: checkpoint {where / tag} has no usable {missing[0]!r} in its "
                         f"client_state data position: damaged, or not written by infinity-train")
    return ResumePoint(where, tag, step, data)


def _natural(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def data_state(batches: Batches, seq_len: int) -> dict[str, int]:
    return {"epoch": batches.epoch, "next": batches.position, "rows": len(batches.rows),
            "seq_len": seq_len, "batch_size": batches.batch_size, "seed": batches.seed}


def check_same_data(point: ResumePoint, now: dict[str, int]) -> None:
    """InputError naming the first setting that differs from the checkpoint's."""
    for key, option in FIXED.items():
        if point.data.get(key) != now[key]:
            raise InputError(f"--resume: the checkpoint at step {point.step} was made with "
                             f"{option} {point.data.get(key)}, this run has {now[key]} (use the "
                             "same model, data, --seq-len, --batch-size, --seed and eval split)")


class Saver:
    """Saves the job's checkpoints, each at most once per step."""

    def __init__(self, output: pathlib.Path, seq_len: int) -> None:
        self.directory = directory(output)
        self.seq_len = seq_len
        self.last_step: int | None = None
        self.last_path: pathlib.Path | None = None

    def save(self, engine: Engine, batches: Batches, step: int) -> pathlib.Path | None:
        if step == self.last_step:
            return None
        client_state: dict[str, Any] = {"step": step, "data": data_state(batches, self.seq_len)}
        path = engine.save_checkpoint(self.directory, f"step{step}", client_state)
        self.last_step, self.last_path = step, path
        logger.info("checkpoint %s saved", path)
        return path


def trim_metrics(path: pathlib.Path, last_step: int) -> None:
    """Drop the lines of steps after `last_step` (run by a job that died before its next
    checkpoint: the resumed run does them again), so the file has each step once."""
    if not path.exists():
        return
    lines = path.read_bytes().decode(errors="replace").splitlines(keepends=True)
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            step = json.loads(line)["step"]
            if not _natural(step):
                raise TypeError
        except (ValueError, KeyError, TypeError, RecursionError):
            if number < len(lines):
                raise InputError(f"--resume: {path}:{number} is not a metrics record") from None
            logger.warning("%s: its last line is partial (the run died writing it); dropped", path)
            continue
        if step <= last_step:
            kept.append(line)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("".join(kept))
    partial.replace(path)
