"""Engine: forward / backward / step of a model whose parameters, gradients and optimizer state
live in the tiered store (DeepSpeed's engine API), on one process or on data-parallel ranks
(torchrun; what each ZeRO stage partitions is in infinity/engine/_partition.py).

    engine = infinity.initialize(model, config)
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()          # every micro-batch; updates at accumulation boundaries

Order of one step (at a boundary): release every unit (the values are about to change), global
gradient norm over the units' flat gradient buffers, fp16 overflow check (skip, lower the scale),
clip factor, one optimizer step over the units, zero the gradient buffers, LR schedule.

[Note: optimizer overlapped with backward] When the step needs no gradient but a unit's own
(no clipping, no fp16 overflow check), the backward of a boundary micro-batch steps each unit on
a worker thread as soon as its gradients are final, while backward goes on with earlier layers.
The unit was released first, so nothing computes from its values while they change. Each unit
gets the same kernel call with the same gradient and grad_scale as after backward, so the
result is the same. Resident units (held until the step) are stepped after backward. With
clipping or fp16 the whole step runs after backward (the norm / overflow needs every gradient).
With several ranks, the collectives that make a unit's gradient final (all-reduce, or
reduce-scatter) run in the backward hook before the unit is handed to the worker; the worker
runs only the Adam step, never a collective.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from infinity.config import AdamParams, Config, OptimizerConfig, build_lr_schedule
from infinity.engine import _checkpoint
from infinity.engine._partition import RankedUnits
from infinity.engine._placement import choose_model_precision, lay_out, open_store, take_placed
from infinity.engine._timeline import Timeline
from infinity.errors import ConfigError
from infinity.memory import peak_rss_bytes, set_mmap_threshold
from infinity.optim import DynamicLossScaler, SwappedOptimizer
from infinity.store import TensorStore, Tier
from infinity.zero import (
    FetchUnit,
    ModelHooks,
    ParamCoordinator,
    Partition,
    Ranks,
    UnitState,
    buffers_to,
    create_units,
    is_deferred,
    place_units,
)

logger = logging.getLogger(__name__)

ASYNC_SAVE_BUDGET_NBYTES = 256 << 20  # host copies a background checkpoint save may queue

_DEFAULT_OPTIMIZER = OptimizerConfig(type="AdamW", params=AdamParams())  # no "optimizer" section


class Engine:
    """A model wrapped for training with ZeRO-3 style offload; build it with `infinity.initialize`.

    Attributes:
        module: the wrapped model (its parameters hold empty placeholders between uses).
        global_steps: optimizer steps taken (skipped fp16 steps included, as DeepSpeed counts).
        micro_steps: calls of `step()` (one per micro-batch).
    """

    def __init__(self, model: torch.nn.Module, config: Config) -> None:
        self.config = config
        self.module = model
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._closed = False
        zero = config.zero_optimization
        adam = (config.optimizer or _DEFAULT_OPTIMIZER).params
        self._schedule = None if config.scheduler is None else \
            build_lr_schedule(config.scheduler, optimizer_lr=adam.lr)  # its errors come first
        self.ranks = Ranks.from_environment(timeout_s=config.infinity.collective_timeout)
        if self.ranks.world != config.world_size:
            raise ConfigError(f"the config was loaded for world_size {config.world_size} but this job has "
                              f"{self.ranks.world} ranks: load it with load_config(..., world_size="
                              f"{self.ranks.world}) or use infinity.initialize")
        self.partition = Partition(self.ranks, zero.stage)
        if config.infinity.mmap_threshold is not None:
            set_mmap_threshold(config.infinity.mmap_threshold)
        self.precision, self.device = choose_model_precision(config)
        placed = take_placed(model, config, self.precision, self.device,  # see [Note: placed models]
                             sharded_params=self.partition.params)
        deferred = placed is None and is_deferred(model)  # built under zero.Init
        if placed is None:
            if config.fp16.enabled or config.bf16.enabled:
                model.to(self.precision.compute)
            buffers_to(model, self.device) if deferred else model.to(self.device)
            layout = lay_out(model, config, self.precision, self.device, meta_ok=deferred)
        else:
            layout = placed.layout
        self.units, uses, self.plan = layout.units, layout.uses, layout.plan
        self.ranks.check_same(_fingerprint(config, self.units), "the config or the model's layout")
        self.timeline = Timeline(time.perf_counter())
        self.store = open_store(layout, config, rank=self.ranks.rank) if placed is None else placed.store
        self.coordinator: ParamCoordinator | None = None
        self._hooks: ModelHooks | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._stepping: dict[int, Future] | None = None  # units stepped during this backward
        self._trained = [u for u in self.units if u.requires_grad]
        self._index = {u: i for i, u in enumerate(self._trained)}
        self._ranked = RankedUnits(self.partition, self._trained)
        try:
            partition = self.partition if self.ranks.world > 1 else None
            if deferred:  # see [Note: deferred parameters]
                create_units(model, self.units, self.store, home=self.plan.param_home, device=self.device,
                             partition=partition)
            elif placed is None:
                place_units(self.units, self.store, home=self.plan.param_home, device=self.device,
                            partition=partition)
            for u in self._trained:  # in RAM unless the budget cannot hold them there
                u.grad = self._ranked.make_grad(u, self.store, self.plan.grads_tier)
            self.coordinator = ParamCoordinator(
                self.units, self.store, fetch_tier=self.plan.fetch_tier, device=self.device,
                prefetch_numel=self.plan.prefetch_numel, max_live_numel=zero.stage3_max_live_parameters,
                max_reuse_numel=zero.stage3_max_reuse_distance, on_grads_final=self._grads_final,
                gather=self.ranks if self.partition.params else None)
            self._hooks = ModelHooks(model, self.units, uses, self.coordinator)
            self.optimizer = self._make_optimizer()
        except BaseException:
            # The model gets back what was moved; not gathered from the ranks, which may be
            # elsewhere (a rank-local failure), so stage 3 on several ranks leaves placeholders.
            self._teardown(restore_params=not self.partition.params)
            raise
        fp16 = config.fp16
        self.scaler = DynamicLossScaler(
            scale=fp16.initial_scale, window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
            min_scale=fp16.min_loss_scale) if fp16.enabled and fp16.dynamic else None
        self._static_scale = fp16.initial_scale if fp16.enabled and not fp16.dynamic else 1.0
        self._schedule_steps = 0
        if self._schedule is not None:
            self.optimizer.lr = self._schedule.lr_at(-1)
        self.last_grad_norm: float | None = None
        # See [Note: optimizer overlapped with backward].
        self.overlap = config.gradient_clipping == 0 and not fp16.enabled
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="infinity-optim") if self.overlap else None
        self.units_stepped_in_backward = 0
        self._queued: deque[int] = deque()  # units submitted to the worker, the running one first
        self._pending_save: Future[Path] | None = None  # a background checkpoint save

    def _make_optimizer(self) -> SwappedOptimizer:
        """Per-unit CPU Adam with its state in the store's host tier (offload_optimizer "none"
        or "cpu") or NVMe tier."""
        opt = self.config.optimizer or _DEFAULT_OPTIMIZER
        p = opt.params
        hyper = {"lr": p.lr, "betas": p.betas, "eps": p.eps, "weight_decay": p.weight_decay,
                 "adamw_mode": opt.decoupled_weight_decay}
        specs = self._ranked.optimizer_specs()
        self._opt_index = {i: j for j, i in enumerate(specs)}  # trained unit -> optimizer unit
        return SwappedOptimizer.from_units(list(specs.values()), self.store, state_tier=self.plan.state_tier,
                                           tile_numel=self.config.zero_optimization.sub_group_size,
                                           **hyper)

    # -- training loop -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model; returns what the model returns. The first batch decides batch sizes
        the config left to it ("auto"): the first dimension of the first tensor argument."""
        self._check_open()
        if self.config.batch_pending:
            first = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.dim()), None)
            if first is not None:
                self.config = self.config.with_micro_batch(int(first.shape[0]))
                logger.info("batch sizes from the first batch: micro %d, train %d",
                            self.config.train_micro_batch_size_per_gpu, self.config.train_batch_size)
        with self.timeline.region("forward", "compute"):
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backpropagate `loss` divided by gradient_accumulation_steps (times the fp16 loss
        scale); gradients land in the units' flat buffers. Returns `loss` unchanged."""
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError("backward() needs a scalar loss tensor that requires grad, got "
                             f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
        if self._stepping is not None:
            raise RuntimeError("backward() twice in one accumulation boundary: call step() first")
        scaled = loss
        if self.config.gradient_accumulation_steps > 1:
            scaled = scaled / self.config.gradient_accumulation_steps
        if self.config.fp16.enabled:
            scaled = scaled * self._loss_scale()
        if self.overlap and self.is_gradient_accumulation_boundary():
            self.optimizer.begin_step()
            self._stepping = {}
        try:
            with self.timeline.region("backward", "compute"):
                scaled.backward()
        finally:
            self.coordinator.end_backward()
        return loss

    def _grads_final(self, unit: FetchUnit) -> None:
        """Coordinator callback: average the unit's gradient over the ranks at the boundary
        (stages 0-1), and start its optimizer step when overlapping."""
        self.timeline.record(unit.key, "grads final", time.perf_counter())
        if unit.requires_grad and self.is_gradient_accumulation_boundary():
            self._ranked.average(self._index[unit])
        if self._stepping is not None and unit.requires_grad and not unit.persistent \
                and unit.state is UnitState.RELEASED:
            i = self._index[unit]
            self._queued.append(i)
            if len(self._queued) == 2:  # the worker is on the one before: read this one's state
                self._prefetch_state(i)
            self._stepping[i] = self._worker.submit(self._step_queued, i, unit)
            self.units_stepped_in_backward += 1

    def _step_queued(self, i: int, unit: FetchUnit) -> None:
        """The worker's step of a unit final in backward; the unit queued after it (if any) has
        its state read meanwhile (a hint: an error there shows when that unit is stepped)."""
        try:
            if len(self._queued) > 1:
                self._prefetch_state(self._queued[1])
            self._step_unit(i, unit, 1.0)
        finally:
            self._queued.popleft()

    def _prefetch_state(self, i: int) -> None:
        j = self._opt_index.get(i)
        if j is not None:  # this rank steps part of the unit
            self.optimizer.prefetch_unit(j)

    def _step_unit(self, i: int, unit: FetchUnit, grad_scale: float) -> None:
        j = self._opt_index.get(i)
        if j is None:  # this rank owns no element of the unit
            return
        with self.timeline.region(unit.key, "optimizer"):
            if unit.grad is None:
                self.optimizer.step_unit(j, torch.zeros(unit.numel, dtype=unit.compute_dtype),
                                         grad_scale=grad_scale)
                return
            with unit.grad.read() as grad:
                self.optimizer.step_unit(j, self._ranked.grad_part(i, grad), grad_scale=grad_scale)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def step(self) -> None:
        """Call after every backward; updates the parameters at accumulation boundaries."""
        self._check_open()
        if self.is_gradient_accumulation_boundary():
            with self.timeline.region("step", "compute"):
                self._take_step()
        self.micro_steps += 1

    def _loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else self._static_scale

    def _take_step(self) -> None:
        self.global_steps += 1
        self.coordinator.release_all()
        self._ranked.average_rest()
        stepping, self._stepping = self._stepping, None
        if stepping is not None:
            self._finish_overlapped(stepping)
            return
        scale = self._loss_scale()
        norm = self._grad_norm() / scale
        self.last_grad_norm = norm
        if self.config.fp16.enabled:
            overflow = not math.isfinite(norm)
            if self.scaler is not None:
                self.scaler.update(overflow)
            if overflow:
                logger.info("step %d skipped: gradient overflow, loss scale now %g",
                            self.global_steps, self._loss_scale())
                self.skipped_steps += 1
                self._zero_grads()
                return
        clip = 1.0
        if self.config.gradient_clipping > 0 and norm > 0:
            clip = min(1.0, self.config.gradient_clipping / (norm + 1e-6))
        self.optimizer.begin_step()
        for i, unit in enumerate(self._trained):
            self._step_unit(i, unit, clip / scale)
        self._end_step()

    def _finish_overlapped(self, stepping: dict[int, Future]) -> None:
        """Wait for the units stepped during backward, step the others here."""
        self.last_grad_norm = None
        for i, unit in enumerate(self._trained):
            future = stepping.get(i)
            error = future.exception() if future is not None else None
            if error is not None:
                logger.warning("optimizer step of %s on the worker failed (%s); retrying", unit.key, error)
            if future is None or error is not None:
                self._step_unit(i, unit, 1.0)  # retry-safe: tiles already stepped are skipped
        self._end_step()

    def _end_step(self) -> None:
        self.optimizer.finish_step()
        self._ranked.gather_values(self.store)
        self._zero_grads()
        if self.global_steps % self.config.steps_per_print == 0:
            p = self.coordinator.stats
            logger.info("step %d: lr %.3g, grad norm %s, prefetch hits %d, on demand %d, stall %.2f s",
                        self.global_steps, self.optimizer.lr,
                        "n/a" if self.last_grad_norm is None else f"{self.last_grad_norm:.4g}",
                        p.prefetch_hits, p.on_demand, p.stall_s)
        if self._schedule is not None:  # as DeepSpeed: the schedule advances on applied steps
            self._schedule_steps += 1
            self.optimizer.lr = self._schedule.lr_at(self._schedule_steps - 1)

    def _grad_norm(self) -> float:
        """L2 norm over every unit's gradient buffer (sum of squares in float64; over every
        rank's shard when the gradients are partitioned)."""
        total = 0.0
        for u in self._trained:
            if u.grad is not None and u.grad.has_grad:
                with u.grad.read() as grad:
                    total += float(torch.linalg.vector_norm(grad, dtype=torch.float32)) ** 2
        return math.sqrt(self._ranked.global_sum_of_squares(total))

    def _zero_grads(self) -> None:
        self._ranked.new_step()
        for u in self._trained:
            if u.grad is not None:
                u.grad.zero()

    # -- modes and views -------------------------------------------------------------------------

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def get_lr(self) -> list[float]:
        return [float(self.optimizer.lr)]

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, a copy of its current values) one unit at a time (bounded memory)."""
        self._check_open()
        self.coordinator.release_all()
        for unit in self.units:
            yield from _unit_values(self.store, unit, self._ranked)

    def stats(self) -> dict[str, Any]:
        """Store tiers and moves, prefetch counters, steps, and peak host memory (VmHWM)."""
        return {"store": self.store.stats(), "prefetch": asdict(self.coordinator.stats),
                "global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                "optimizer": {"overlap": self.overlap,
                              "units_stepped_in_backward": self.units_stepped_in_backward},
                "loss_scale": self._loss_scale() if self.config.fp16.enabled else None,
                "peak_rss_bytes": peak_rss_bytes()}

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """Save the store's moves and the engine's timeline as one Chrome / Perfetto trace."""
        self.store.write_trace(path)
        self.timeline.merge_into(path)

    # -- checkpoints (infinity/engine/_checkpoint.py) ------------------------------------------

    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None,
                        client_state: dict[str, Any] | None = None, *, async_save: bool = False,
                        async_budget_nbytes: int = ASYNC_SAVE_BUDGET_NBYTES) -> Path:
        """Save everything needed to continue bit-identically as `tag` (default `step<N>`)
        under `save_dir`, crash-safe, and point `save_dir/latest` at it (docs/checkpoints.md).
        With async_save the last `async_budget_nbytes` of copies are written while training
        goes on; the next save, load or close() waits for it. Returns the tag's path."""
        self._check_open()
        self.wait_for_checkpoint()
        self._pending_save = _checkpoint.save_checkpoint(
            self, save_dir, tag, client_state, async_budget_nbytes=async_budget_nbytes if async_save else None)
        return Path(save_dir) / (tag or f"step{self.global_steps}")

    def wait_for_checkpoint(self) -> None:
        """Wait for a background save; raise its error."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.result()

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None, *,
                        load_optimizer_states: bool = True) -> dict[str, Any]:
        """Restore a checkpoint (tag None: `load_dir/latest`); returns its client_state."""
        self._check_open()
        self.wait_for_checkpoint()
        return _checkpoint.load_checkpoint(self, load_dir, tag, load_optimizer_states=load_optimizer_states)

    # -- end -------------------------------------------------------------------------------------

    def close(self, *, restore_params: bool = True) -> None:
        """Remove every hook and free the store. With restore_params the model gets its current
        values back as ordinary tensors (needs RAM for the whole model), else placeholders stay."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_for_checkpoint()
        finally:
            self._teardown(restore_params=restore_params)

    def _teardown(self, *, restore_params: bool) -> None:
        """Undo what __init__ did, as far as it got."""
        try:
            if self._worker is not None:
                self._worker.shutdown(wait=True)
            self._stepping = None
            if self.coordinator is not None:
                self.coordinator.abort_pass()  # a failed forward may have left modules in use
                self.coordinator.release_all()
            if self._hooks is not None:
                self._hooks.remove()
            if restore_params and not self.ranks.failed:
                for unit in self.units:
                    if unit.key in self.store:
                        values = dict(_unit_values(self.store, unit, self._ranked))
                        for s in unit.slots:
                            s.param.data = values[s.name].to(self.device, unit.compute_dtype)
        finally:
            self.store.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")


def _fingerprint(config: Config, units: list[FetchUnit]) -> str:
    """What every rank must agree on: the config (less what each machine fills in, such as the
    host memory budget) and the model's units."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in ("infinity", "auto_filled")}
    layout = [(u.key, u.numel, str(u.dtype), u.requires_grad) for u in units]
    return repr((sorted(fields.items()), config.infinity.compute_dtype, layout))


def _unit_values(store: TensorStore, unit: FetchUnit, ranked: RankedUnits) -> Iterator[tuple[str, torch.Tensor]]:
    flat = store.fetch(unit.key, Tier.HOST).result()
    try:
        flat = ranked.whole_values(flat, unit)
        copies = [(s.name, flat[s.offset:s.offset + s.shape.numel()].view(s.shape).clone()) for s in unit.slots]
    finally:
        store.release(unit.key, Tier.HOST)
    yield from copies
