"""Engine.save_checkpoint / load_checkpoint over the Infinity checkpoint format (infinity.checkpoint).

What a checkpoint of an engine holds, by parameter name (so it does not depend on how the
parameters were grouped into units, and any rank count can read its share):
- `<name>`: the parameter's values as stored (fp32, or bf16/fp16);
- `master/<name>`: the fp32 master of a bf16/fp16 parameter; `exp_avg/<name>`,
  `exp_avg_sq/<name>`: Adam's moments (streamed out of the optimizer's tiles unit by unit, so
  NVMe state is never gathered in RAM beyond one unit);
- `rng/...` and metadata: step counters, Adam's step, the LR, the loss scaler, RNG states, the
  config, the caller's `client_state`, and a transformers model's config and generation config
  (so `infinity-convert --to hf` needs nothing else).

Load reads a checkpoint written by save, or by `infinity-convert --to infinity` from DeepSpeed
(whose `<name>` are fp32 masters). A checkpoint without moments loads only with
`load_optimizer_states=False` (moments start from zero, said in the log).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator
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
    save_rng_state,
)
from infinity.errors import CheckpointError
from infinity.store import Tier

if TYPE_CHECKING:
    from infinity.engine._engine import Engine

logger = logging.getLogger(__name__)

MASTER = "master"


def save_checkpoint(engine: Engine, directory: str | Path, tag: str | None = None,
                    client_state: dict[str, Any] | None = None, *,
                    async_budget_nbytes: int | None = None) -> Future[Path]:
    """Write the engine's whole training state as tag `tag` (default `step<global_steps>`)
    under `directory` and point `directory/latest` at it.

    With `async_budget_nbytes` the tensors are copied to host memory (at most that many bytes
    wait at once) and written by a worker thread: this returns once the last copy is queued,
    and the Future completes when the tag is committed. Without, the Future is already done."""
    if engine.micro_steps % engine.config.gradient_accumulation_steps:
        logger.warning("checkpoint in the middle of gradient accumulation (micro step %d): the "
                       "accumulated gradients are not saved", engine.micro_steps)
    engine.coordinator.release_all()
    tag = tag or f"step{engine.global_steps}"
    metadata = _metadata(engine, client_state)
    if async_budget_nbytes is None:
        with CheckpointWriter(directory, tag, metadata=metadata) as writer:
            _write_state(engine, writer)
        done: Future[Path] = Future()
        done.set_result(writer.path)
        return done
    saver = AsyncCheckpointWriter(directory, tag, metadata=metadata, budget_nbytes=async_budget_nbytes)
    try:
        _write_state(engine, saver)
    except BaseException:
        saver.abort()
        raise
    return saver.commit()


def _write_state(engine: Engine, writer: CheckpointWriter | AsyncCheckpointWriter) -> None:
    """Every tensor of the engine's state, one unit at a time, then the RNG states."""
    for unit in engine.units:
        for name, values in _unit_values(engine, unit):
            writer.add(name, values)
    for i, state in engine.optimizer.iter_state():
        unit = engine._trained[i]
        rows = ([MASTER] if unit.dtype != torch.float32 else []) + list(ADAM_STATES)
        for row in rows:
            flat = state[row].reshape(-1)
            for s in unit.slots:
                writer.add(optimizer_state_name(row, s.name),
                           flat[s.offset:s.offset + s.shape.numel()].view(s.shape))
    save_rng_state(writer)


def load_checkpoint(engine: Engine, directory: str | Path, tag: str | None = None, *,
                    load_optimizer_states: bool = True) -> dict[str, Any]:
    """Restore what save_checkpoint wrote (tag None: the one `directory/latest` names); returns
    the saved `client_state`. CheckpointError naming the parameter when the checkpoint lacks
    one or has another shape."""
    reader = CheckpointReader(directory, tag)
    engine.coordinator.release_all()
    names = set(reader.names())
    for unit in engine.units:
        _check_unit(reader, names, unit)
    has_moments = all(optimizer_state_name(state, s.name) in names for u in engine._trained
                      for s in u.slots for state in ADAM_STATES)
    if not has_moments and load_optimizer_states:
        raise CheckpointError(f"checkpoint {reader.path} holds no Adam moments for every "
                              f"parameter; load_checkpoint(..., load_optimizer_states=False) "
                              f"starts them from zero")
    for unit in engine.units:
        values = engine.store.fetch(unit.key, Tier.HOST).result()
        try:
            for s in unit.slots:
                values[s.offset:s.offset + s.shape.numel()] = reader.read(s.name).reshape(-1).to(unit.dtype)
        finally:
            engine.store.release(unit.key, Tier.HOST, dirty=True)
    saved = reader.metadata.get("engine") or {  # a DeepSpeed conversion's counters
        key: reader.metadata[key] for key in ("global_steps", "skipped_steps", "optimizer_step")
        if isinstance(reader.metadata.get(key), int)}
    step = int(saved.get("optimizer_step") or 0)
    if not has_moments:
        logger.warning("checkpoint %s: no optimizer moments; Adam starts from zero moments at step 0",
                       reader.path)
        step = 0
    engine.optimizer.load_state(_optimizer_states(engine, reader, names, step, has_moments))
    _restore_counters(engine, saved)
    if "rng" in reader.metadata:
        load_rng_state(reader)
    logger.info("engine restored from %s (step %d)", reader.path, engine.global_steps)
    return reader.metadata.get("client_state") or {}


def _unit_values(engine: Engine, unit) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, values) of the unit's parameters; the unit's entry is held while they are written."""
    flat = engine.store.fetch(unit.key, Tier.HOST).result()
    try:
        for s in unit.slots:
            yield s.name, flat[s.offset:s.offset + s.shape.numel()].view(s.shape)
    finally:
        engine.store.release(unit.key, Tier.HOST)


def _check_unit(reader: CheckpointReader, names: set[str], unit) -> None:
    for s in unit.slots:
        if s.name not in names:
            raise CheckpointError(f"checkpoint {reader.path} has no parameter {s.name!r}")
        if tuple(reader.shape(s.name)) != tuple(s.shape):
            raise CheckpointError(f"checkpoint {reader.path}: parameter {s.name!r} has shape "
                                  f"{tuple(reader.shape(s.name))}, the model's is {tuple(s.shape)}")


def _optimizer_states(engine: Engine, reader: CheckpointReader, names: set[str], step: int,
                      has_moments: bool) -> Iterator[tuple[int, dict[str, Any]]]:
    """What SwappedOptimizer.load_state takes, unit by unit (one unit's state in memory)."""
    for i, unit in enumerate(engine._trained):
        state: dict[str, Any] = {"step": step}
        rows = [MASTER, *ADAM_STATES]
        for row in rows:
            flat = torch.empty(unit.numel, dtype=torch.float32)
            for s in unit.slots:
                name = optimizer_state_name(row, s.name)
                if row == MASTER:  # DeepSpeed conversions and fp32 runs: the weights are the master
                    name = name if name in names else s.name
                if row != MASTER and not has_moments:
                    flat.zero_()
                    continue
                flat[s.offset:s.offset + s.shape.numel()] = reader.read(name).reshape(-1).float()
            state[row] = flat
        yield i, state


def _metadata(engine: Engine, client_state: dict[str, Any] | None) -> dict[str, Any]:
    module_config = getattr(engine.module, "config", None)
    generation = getattr(engine.module, "generation_config", None)
    return {
        "engine": {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                   "skipped_steps": engine.skipped_steps,
                   "optimizer_step": engine.optimizer.completed_steps,
                   "schedule_steps": engine._schedule_steps, "lr": engine.optimizer.lr,
                   "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None},
        "config": json.loads(json.dumps(dataclasses.asdict(engine.config), default=str))
        if dataclasses.is_dataclass(engine.config) else str(engine.config),
        "client_state": client_state or {},
        **({"model_config": module_config.to_dict()} if hasattr(module_config, "to_dict") else {}),
        **({"generation_config": generation.to_dict()} if hasattr(generation, "to_dict") else {}),
    }


def _restore_counters(engine: Engine, saved: dict[str, Any]) -> None:
    engine.global_steps = int(saved.get("global_steps", 0))
    engine.micro_steps = int(saved.get("micro_steps", 0))
    engine.skipped_steps = int(saved.get("skipped_steps", 0))
    engine._schedule_steps = int(saved.get("schedule_steps", 0))
    if "lr" in saved:
        engine.optimizer.lr = float(saved["lr"])
    scaler = saved.get("loss_scaler")
    if engine.scaler is not None and scaler is not None:
        engine.scaler.load_state_dict(scaler)
