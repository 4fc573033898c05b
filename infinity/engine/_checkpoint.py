"""Engine.save_checkpoint / load_checkpoint over the Infinity checkpoint format
(infinity.checkpoint).

What a checkpoint of an engine holds, by parameter name (so it does not depend on how the
parameters were grouped into units, and any rank count can read its share):
- `<name>`: the parameter's values as stored (fp32, or bf16/fp16);
- `master/<name>`: the fp32 master of a bf16/fp16 parameter; `exp_avg/<name>`,
  `exp_avg_sq/<name>`: Adam's moments (streamed out of the optimizer's tiles unit by unit, so
  NVMe state is never gathered in RAM beyond one unit);
- `rng/...` and metadata: step counters, Adam's step, the LR, the loss scaler, RNG states, the
  config, the caller's `client_state`, and a transformers model's config and generation config
  (so `infinity-convert --to hf` needs nothing else).

[Note: checkpoints of several ranks] The file holds whole tensors whatever the number of ranks
that wrote it, so any number of ranks reads it back (repartition on load). Every rank calls
save: the shards of each unit (stage 3 values, stage 1-3 optimizer state) are all-gathered one
unit at a time and rank 0 alone writes; a write error on rank 0 does not stop it taking part in
the remaining gathers, and at the end every rank learns whether the tag was committed (all
raise if not). Every rank calls load: each reads the tensors and keeps its part; the ranks then
agree that all succeeded. Each rank's RNG states are saved (rank 0's under the one-process names).

Load reads a checkpoint written by save, or by `infinity-convert --to infinity` from DeepSpeed
(whose `<name>` are fp32 masters). A checkpoint without moments loads only with
`load_optimizer_states=False` (moments start from zero, said in the log).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from infinity.checkpoint import (
    ADAM_STATES,
    AsyncCheckpointWriter,
    CheckpointReader,
    CheckpointWriter,
    load_rng_state,
    optimizer_state_name,
    rng_state,
    save_rng_state,
)
from infinity.engine._step_state import StepCounters
from infinity.errors import CheckpointError
from infinity.store import Tier

if TYPE_CHECKING:
    from infinity.engine._engine import Engine

logger = logging.getLogger(__name__)

MASTER = "master"


def save_checkpoint(engine: Engine, directory: str | Path, tag: str | None = None,
                    client_state: dict[str, Any] | None = None, *,
                    async_budget_nbytes: int | None = None,
                    update_latest: bool = True) -> Future[Path]:
    """Write the engine's whole training state as tag `tag` (default `step<global_steps>`)
    under `directory` and point `directory/latest` at it. Every rank calls it; see
    [Note: checkpoints of several ranks].

    With `async_budget_nbytes` the tensors are copied to host memory (at most that many bytes
    wait at once) and written by a worker thread: this returns once the last copy is queued,
    and the Future completes when the tag is committed. Without, the Future is already done."""
    if engine.micro_steps % engine.config.gradient_accumulation_steps:
        logger.warning("checkpoint in the middle of gradient accumulation (micro step %d): the "
                       "accumulated gradients are not saved", engine.micro_steps)
    engine.coordinator.release_all()
    ranks = engine.ranks
    tag = tag or f"step{engine.global_steps}"
    rng_states = ranks.all_gather_object(rng_state(), "RNG states")
    sink = _RankZeroSink(ranks.world > 1)
    if ranks.rank == 0:
        metadata = _metadata(engine, client_state)
        sink.open(lambda: CheckpointWriter(directory, tag, metadata=metadata,
                                           update_latest=update_latest)
                  if async_budget_nbytes is None else
                  AsyncCheckpointWriter(directory, tag, metadata=metadata,
                                        budget_nbytes=async_budget_nbytes,
                                        update_latest=update_latest))
    try:
        _write_state(engine, sink)
        for rank, state in enumerate(rng_states):
            save_rng_state(sink, state, rank=rank)
    except BaseException:
        sink.abort()
        raise
    done = sink.commit()
    _agree(engine, sink.error, "checkpoint committed",  # only rank 0 writes
           lambda rank, message: (f"rank {rank} could not write checkpoint {tag!r} under "
                                  f"{directory}: {message}"))
    if ranks.rank != 0:
        done.set_result(Path(directory) / tag)
    return done


class _RankZeroSink:
    """What _write_state writes into: rank 0's writer, or nothing on the other ranks. With
    `keep_going` (several ranks) a write error is kept, not raised, so rank 0 still takes part
    in the remaining gathers; the error is raised after the ranks agree on the outcome."""

    def __init__(self, keep_going: bool) -> None:
        self.keep_going = keep_going
        self.writer: CheckpointWriter | AsyncCheckpointWriter | None = None
        self.error: BaseException | None = None
        self.metadata: dict[str, Any] = {}

    def open(self, make: Any) -> None:
        self._do(lambda: setattr(self, "writer", make()))
        if self.writer is not None:
            self.metadata = self.writer.metadata

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.writer is not None and self.error is None:
            self._do(lambda: self.writer.add(name, tensor))

    def commit(self) -> Future[Path]:
        """Commit rank 0's tag (the Future of an async one); abort it after an error."""
        done: Future[Path] = Future()
        if self.writer is None:
            return done
        if self.error is None:
            try:
                if isinstance(self.writer, AsyncCheckpointWriter):
                    return self.writer.commit()
                done.set_result(self.writer.commit())
                return done
            except BaseException as exc:
                self.error = exc
        self.abort()
        return done

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
            self.writer = None

    def _do(self, call: Any) -> None:
        try:
            call()
        except BaseException as exc:
            if not self.keep_going or not isinstance(exc, Exception):
                raise
            logger.error("checkpoint write failed on rank 0 (the ranks finish the save, then all "
                         "raise): %s", exc)
            self.error = exc


def _write_state(engine: Engine, writer: _RankZeroSink) -> None:
    """Every tensor of the engine's state, whole, one unit at a time (gathered from the ranks
    where they are partitioned)."""
    for unit in engine.units:
        for name, values in engine.ranked.unit_values(engine.store, unit):
            writer.add(name, values)
    states = engine.optimizer.iter_state()
    for i, unit in enumerate(engine.ranked.trained):
        # None: this rank owns none of it
        local = next(states)[1] if i in engine.ranked.optimizer_index else None
        rows = ([MASTER] if unit.dtype != torch.float32 else []) + list(ADAM_STATES)
        for row in rows:
            flat = engine.ranked.whole_state(i, None if local is None else local[row]).reshape(-1)
            for s in unit.slots:
                writer.add(optimizer_state_name(row, s.name),
                           flat[s.offset:s.offset + s.shape.numel()].view(s.shape))


def load_checkpoint(engine: Engine, directory: str | Path, tag: str | None = None, *,
                    load_optimizer_states: bool = True,
                    values_only: bool = False) -> dict[str, Any]:
    """Restore what save_checkpoint wrote (tag None: the one `directory/latest` names), on any
    number of ranks; returns the saved `client_state`. With `values_only` only the parameters'
    values are read (optimizer state, counters and RNG stay as they are). CheckpointError naming
    the parameter when the checkpoint lacks one or has another shape."""
    error: BaseException | None = None
    try:
        client_state = _load(engine, directory, tag, load_optimizer_states, values_only)
    except Exception as exc:
        error = exc
    _agree(engine, error, "checkpoint loaded",
           lambda rank, message: (f"rank {rank} could not load the checkpoint from {directory}: "
                                  f"{message}"))
    return client_state


def _agree(engine: Engine, error: BaseException | None, what: str,
           failure: Callable[[int, str], str]) -> None:
    """Every rank learns whether every rank succeeded at `what`: this rank's own error is raised
    as it is, else a CheckpointError (`failure(rank, message)`) for the first rank that failed."""
    failures = engine.ranks.all_gather_object(
        None if error is None else f"{type(error).__name__}: {error}", what)
    if error is not None:
        raise error
    failed = [(rank, message) for rank, message in enumerate(failures) if message is not None]
    if failed:
        raise CheckpointError(failure(*failed[0]))


def _load(engine: Engine, directory: str | Path, tag: str | None, load_optimizer_states: bool,
          values_only: bool) -> dict[str, Any]:
    reader = CheckpointReader(directory, tag)
    engine.coordinator.release_all()
    names = set(reader.names())
    for unit in engine.units:
        _check_unit(reader, names, unit)
    if values_only:
        if any(u.dtype != torch.float32 for u in engine.ranked.trained):
            raise CheckpointError("loading only the values of bf16/fp16 parameters would leave the "
                                  "optimizer's fp32 master weights stale: load the whole "
                                  "checkpoint, or with load_optimizer_states=False")
        _load_values(engine, reader)
        logger.info("engine: parameter values loaded from %s", reader.path)
        return reader.metadata.get("client_state") or {}
    has_moments = all(optimizer_state_name(state, s.name) in names for u in engine.ranked.trained
                      for s in u.slots for state in ADAM_STATES)
    if not has_moments and load_optimizer_states:
        raise CheckpointError(f"checkpoint {reader.path} holds no Adam moments for every "
                              f"parameter; load_checkpoint(..., load_optimizer_states=False) "
                              f"starts them from zero")
    _load_values(engine, reader)
    saved = reader.metadata.get("engine") or {  # a DeepSpeed conversion's counters
        key: reader.metadata[key] for key in ("global_steps", "skipped_steps", "optimizer_step")
        if isinstance(reader.metadata.get(key), int)}
    step = int(saved.get("optimizer_step") or 0)
    if not has_moments:
        logger.warning("checkpoint %s: no optimizer moments; Adam starts from zero moments at "
                       "step 0", reader.path)
        step = 0
    engine.optimizer.load_state(_optimizer_states(engine, reader, names, step, has_moments))
    _restore_counters(engine, saved)
    if "rng" in reader.metadata:
        load_rng_state(reader, rank=engine.ranks.rank)
    written_by = int(saved.get("world_size", 1))
    if written_by != engine.ranks.world:
        logger.info("checkpoint %s was written by %d rank(s), repartitioned for %d", reader.path,
                    written_by, engine.ranks.world)
    logger.info("engine restored from %s (step %d)", reader.path, engine.global_steps)
    return reader.metadata.get("client_state") or {}


def _load_values(engine: Engine, reader: CheckpointReader) -> None:
    """Every unit's values from the checkpoint, into the store (this rank's part)."""
    for unit in engine.units:
        with engine.store.hold(unit.key, Tier.HOST, dirty=True) as values:
            # Read chunk by chunk into the values themselves unless they are partitioned (a
            # stage-3 shard is cut from the whole unit, assembled first).
            whole = torch.empty(unit.numel, dtype=unit.dtype) if engine.partition.params \
                else values
            for s in unit.slots:
                reader.read_flat(s.name, 0, s.shape.numel(),
                                 out=whole[s.offset:s.offset + s.shape.numel()])
            if whole is not values:
                values.copy_(engine.ranked.own_values(unit, whole))


def _check_unit(reader: CheckpointReader, names: set[str], unit) -> None:
    for s in unit.slots:
        if s.name not in names:
            raise CheckpointError(f"checkpoint {reader.path} has no parameter {s.name!r}")
        if tuple(reader.shape(s.name)) != tuple(s.shape):
            raise CheckpointError(f"checkpoint {reader.path}: parameter {s.name!r} has shape "
                                  f"{tuple(reader.shape(s.name))}, the model's is {tuple(s.shape)}")


def _optimizer_states(engine: Engine, reader: CheckpointReader, names: set[str], step: int,
                      has_moments: bool) -> Iterator[tuple[int, dict[str, Any]]]:
    """What SwappedOptimizer.load_state takes, unit by unit: rows read from the checkpoint one
    tile's segment at a time as the optimizer fills its tiles (this rank's part of them)."""
    for i, unit in enumerate(engine.ranked.trained):
        j = engine.ranked.optimizer_index.get(i)
        if j is None:  # this rank steps no element of the unit
            continue
        first, real, numel = engine.ranked.own_state_span(i)
        state: dict[str, Any] = {"step": step}
        for row in [MASTER, *ADAM_STATES]:
            if row != MASTER and not has_moments:
                state[row] = torch.zeros(1).expand(numel)  # no memory behind the zeros
                continue
            pieces = []
            for s in unit.slots:
                name = optimizer_state_name(row, s.name)
                if row == MASTER:  # DeepSpeed conversions and fp32 runs: the weights are the master
                    name = name if name in names else s.name
                pieces.append((name, s.offset, s.shape.numel()))
            state[row] = _SavedRow(reader, pieces, first, real, numel)
        yield j, state


class _SavedRow:
    """One optimizer row of a unit's part (elements [first, first + real) of the whole row,
    zero padded to `numel`), read from the checkpoint by range (optimizer._state.RowSource):
    `pieces` are (tensor name, offset in the unit, elements) of the unit's parameters."""

    def __init__(self, reader: CheckpointReader, pieces: list[tuple[str, int, int]], first: int,
                 real: int, numel: int) -> None:
        self._reader, self._pieces = reader, pieces
        self._first, self._real, self._numel = first, real, numel

    def numel(self) -> int:
        return self._numel

    def read_into(self, start: int, stop: int, out: torch.Tensor) -> None:
        lo, hi = self._first + start, self._first + min(stop, self._real)  # in the whole row
        for name, offset, count in self._pieces:
            a, b = max(lo, offset), min(hi, offset + count)
            if a < b:
                self._reader.read_flat(name, a - offset, b - offset, out=out[a - lo:b - lo])
        if stop > self._real:
            out[max(start, self._real) - start:].zero_()


def _metadata(engine: Engine, client_state: dict[str, Any] | None) -> dict[str, Any]:
    module_config = getattr(engine.module, "config", None)
    generation = getattr(engine.module, "generation_config", None)
    return {
        "engine": {**dataclasses.asdict(engine.counters),
                   "world_size": engine.ranks.world,
                   "zero_stage": engine.config.zero_optimization.stage,
                   "optimizer_step": engine.optimizer.completed_steps, "lr": engine.optimizer.lr,
                   "loss_scaler": (engine.scaler.state_dict() if engine.scaler is not None
                                   else None)},
        "config": json.loads(json.dumps(dataclasses.asdict(engine.config), default=str))
        if dataclasses.is_dataclass(engine.config) else str(engine.config),
        "client_state": client_state or {},
        **({"model_config": module_config.to_dict()} if hasattr(module_config, "to_dict") else {}),
        **({"generation_config": generation.to_dict()} if hasattr(generation, "to_dict") else {}),
    }


def _restore_counters(engine: Engine, saved: dict[str, Any]) -> None:
    engine.counters = StepCounters.from_saved(saved)
    if "lr" in saved:
        engine.optimizer.lr = float(saved["lr"])
    scaler = saved.get("loss_scaler")
    if engine.scaler is not None and scaler is not None:
        engine.scaler.load_state_dict(scaler)
