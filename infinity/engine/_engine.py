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
result is the same. The store is told the unit's values are needed again soon (the worker reads
them; the trace alone says "at the next forward", so they went first and were read from NVMe
again), and once stepped, that they are needed last. A unit's gradient is let go as soon as it
is stepped, so the gradients held at once are those of the units backward is ahead of the
worker by, not the whole model's. Resident units (held until the step) are stepped after backward. With
clipping or fp16 the whole step runs after backward (the norm / overflow needs every gradient).
It pays where the step waits on something other than the cores backward computes on (NVMe,
an accelerator); with CPU compute and everything in RAM the worker and backward only take turns
on the same cores (interleaved A/B on a 294M GPT: 1.11x plain PyTorch overlapped, see
docs/performance.md), so `infinity.overlap_optimizer` "auto" leaves it off there. With several
ranks, the collectives that make a unit's gradient final (all-reduce, or reduce-scatter) run in
the backward hook before the unit is handed to the worker; the worker runs only the Adam step,
never a collective.

[Note: the step's tail in the next forward] Backward finishes units last layer first, so when it
ends the worker still has the first layers to step (with NVMe: read state, update, write back),
and those are what the next forward needs first. On one process `step()` does not wait for
them: the units not started yet are re-sorted into forward order (resident units first) and
`step()` returns; the next forward waits for each unit's step before fetching its values (the
coordinator's `ready` callback) and prefetches only units already stepped, so the forward's
reads and the tail's reads and write-backs share the disk (issue 7: the forward alone read at
~1.2 GB/s against the ~2 GB/s of reads and writes together). Each unit still gets the kernel call
it got before, with the step's learning rate (taken when backward started; the schedule moves
on at `step()` as before), so the result is the same. What needs the whole step done waits for
it: the next backward (gradients accumulate again only after every unit was stepped), and
named_parameters, checkpoints, close and `synchronize()`. A unit whose step failed on the worker
is stepped again on the waiting thread (retry-safe) and its error raised there if it fails again.
With several ranks `step()` waits as before (stages 1-2 gather the values after the step).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from infinity.config import AdamParams, Config, OptimizerConfig, build_lr_schedule
from infinity.engine import _checkpoint
from infinity.engine._client import LRSource
from infinity.engine._overlap import UnitStepper
from infinity.engine._partition import RankedUnits
from infinity.engine._placement import (
    choose_model_precision,
    lay_out,
    open_store,
    optimizer_overlaps,
    take_placed,
)
from infinity.engine._plan import MemoryPlan
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

_FETCHES_PER_UNIT_STEP = 4.0  # store fetches one unit's step makes (values, tiles): next-use hints

_DEFAULT_OPTIMIZER = OptimizerConfig(type="AdamW", params=AdamParams())  # no "optimizer" section


class Engine:
    """A model wrapped for training with ZeRO-3 style offload; build it with `infinity.initialize`.

    Attributes:
        module: the wrapped model (its parameters hold empty placeholders between uses, unless
            every unit is resident: offload_param none on one process, see `keeps_units_resident`).
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
        threshold = _mmap_threshold(config, self.plan)
        if threshold is not None:
            set_mmap_threshold(threshold)
        self.overlap = optimizer_overlaps(config, self.device)  # its errors before anything is opened
        self.ranks.check_same(_fingerprint(config, self.units), "the config or the model's layout")
        self.timeline = Timeline(time.perf_counter())
        self.store = open_store(layout, config, rank=self.ranks.rank) if placed is None else placed.store
        self.coordinator: ParamCoordinator | None = None
        self._hooks: ModelHooks | None = None
        self._stepper: UnitStepper | None = None
        self._stepping = False  # units are stepped during this backward
        self._tail_open = False  # see [Note: the step's tail in the next forward]
        self._partial_step = False  # an overlapped step failed after some units were updated
        self._step_lr = 0.0  # the learning rate of the step being built on the worker
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
                gather=self.ranks if self.partition.params else None, ready=self._unit_ready)
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
        self.lr_source: LRSource | None = None  # a client's scheduler (infinity/engine/_client.py)
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary
        self.last_grad_norm: float | None = None
        if self.overlap:
            self._stepper = UnitStepper(self._step_on_worker, self._prefetch_state)
        self.units_stepped_in_backward = 0
        self.units_left_to_forward = 0  # units of a step not yet stepped when step() returned
        self.optimizer_wait_s = 0.0  # forward waiting for units of the last step's tail
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
                                           tile_numel=self.plan.tile_numel, **hyper)

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

    def backward(self, loss: torch.Tensor, *, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate `loss` divided by gradient_accumulation_steps (not with
        `scale_wrt_gas` false: a loss the caller scaled already; times the fp16 loss scale);
        gradients land in the units' flat buffers. Returns `loss` unchanged."""
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError("backward() needs a scalar loss tensor that requires grad, got "
                             f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
        if self._stepping:
            raise RuntimeError("backward() twice in one accumulation boundary: call step() first")
        self._refuse_after_partial_step()
        self.synchronize()  # gradients accumulate again only once every unit was stepped
        scaled = loss
        if scale_wrt_gas and self.config.gradient_accumulation_steps > 1:
            scaled = scaled / self.config.gradient_accumulation_steps
        if self.config.fp16.enabled:
            scaled = scaled * self._loss_scale()
        boundary = self.is_gradient_accumulation_boundary()
        for u in self._trained:  # inf/nan survive the sums: checked once, at the boundary
            if u.grad is not None:
                u.grad.check_now = boundary
        if self.overlap and boundary:
            self._begin_optimizer_step()
            self._step_lr = self.optimizer.lr
            self._stepping = True
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
        if self._stepping and unit.requires_grad and not unit.persistent \
                and unit.state is UnitState.RELEASED:
            # The worker reads these values again soon (not the next forward, as the trace says):
            # keep the copy backward used in RAM.
            self._keep_for_worker({self._index[unit]: self._stepper.pending()})
            self._stepper.submit(self._index[unit])
            self.units_stepped_in_backward += 1

    def _unit_ready(self, unit: FetchUnit, wait: bool) -> bool:
        """Coordinator callback before it fetches a unit's values: False while the last step's
        tail is still stepping the unit; with `wait`, wait for that (stepping it here if it
        failed on the worker) and return True. See [Note: the step's tail in the next forward]."""
        i = self._index.get(unit)
        future = self._stepper.future(i) if self._tail_open and i is not None else None
        if future is None:
            return True
        if not wait:
            return future.done() and future.exception() is None
        start = time.perf_counter()
        try:
            if self._settle_unit(i, unit, future):
                self._stepper.mark_done(i)
        finally:
            self.optimizer_wait_s += time.perf_counter() - start
        return True

    def _settle_unit(self, i: int, unit: FetchUnit, future: Future[None]) -> bool:
        """Wait for unit i's step on the worker; if it failed, step it here (retry-safe: tiles
        already stepped are skipped), raising if that fails too. True if it was stepped here."""
        error = future.exception()
        if error is None:
            return False
        logger.warning("optimizer step of %s on the worker failed (%s); retrying", unit.key, error)
        try:
            self._step_unit(i, unit, 1.0, lr=self._step_lr)
        except ValueError:  # a non-finite gradient (found in backward or where it was stepped):
            self._partial_step = True  # no retry helps, and the units stepped before it stay so
            raise
        return True

    def _keep_for_worker(self, ahead: dict[int, int]) -> None:
        """Tell the store that unit i's values are read by the worker after `ahead[i]` other
        units (a few store fetches each: their values and tiles)."""
        self.store.set_next_use({self._trained[i].key: _FETCHES_PER_UNIT_STEP * (n + 1) for i, n in ahead.items()})

    def _step_on_worker(self, i: int) -> None:
        unit = self._trained[i]
        self._step_unit(i, unit, 1.0, lr=self._step_lr)
        if not self._tail_open:  # stepped during backward: next used at the far end of the next forward
            self.store.set_next_use({unit.key: math.inf})

    def _prefetch_state(self, i: int) -> None:
        j = self._opt_index.get(i)
        if j is not None:  # this rank steps part of the unit
            self.optimizer.prefetch_unit(j)

    def _step_unit(self, i: int, unit: FetchUnit, grad_scale: float, *, finite: bool = False,
                   lr: float | None = None) -> None:
        """Step unit i; `finite`: its gradient is known to be free of inf/nan (a finite norm);
        `lr`: the step's learning rate (default: the optimizer's)."""
        j = self._opt_index.get(i)
        if j is None:  # this rank owns no element of the unit
            return
        with self.timeline.region(unit.key, "optimizer"):
            if unit.grad is None:
                self.optimizer.step_unit(j, torch.zeros(unit.numel, dtype=unit.compute_dtype),
                                         grad_scale=grad_scale, lr=lr)
                return
            if unit.grad.finite is False:  # overlapped: found as its gradient became final
                raise ValueError(f"the gradient of {unit.key} has non-finite values (inf/nan): no parameter "
                                 f"of it was updated; units stepped during backward before it keep their "
                                 f"update (infinity.overlap_optimizer false makes the step all or nothing)")
            with unit.grad.read_pieces() as pieces:  # checked already where accumulated
                self.optimizer.step_unit(j, self._ranked.grad_part(i, pieces), grad_scale=grad_scale,
                                         check_finite=not finite and unit.grad.finite is None, lr=lr)
            unit.grad.zero()  # used up: a gradient held in RAM is freed while the other units step

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last step (DeepSpeed's engine.zero_grad;
        `step()` does it itself): e.g. to skip a batch whose step failed on a non-finite
        gradient, which changed nothing. Counters are kept."""
        self._check_open()
        if self._stepping:
            raise RuntimeError("zero_grad() between a boundary backward and its step(): call step() first")
        self.synchronize()
        self._zero_grads()

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Say whether the next backward and step end an accumulation (DeepSpeed's method: a
        loop whose last accumulation of an epoch is short sets it per micro-batch); None goes
        back to counting micro-batches."""
        self._boundary = is_boundary

    def step(self) -> None:
        """Call after every backward; updates the parameters at accumulation boundaries."""
        self._check_open()
        self._refuse_after_partial_step()
        if self.is_gradient_accumulation_boundary():
            with self.timeline.region("step", "compute"):
                self._take_step()
        self.micro_steps += 1

    def _loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else self._static_scale

    def _take_step(self) -> None:
        self.coordinator.release_all()
        self._ranked.average_rest()
        if self._stepping:
            self.global_steps += 1
            self._stepping = False
            self._queue_the_rest()
            return
        self.synchronize()  # step() twice without a backward between: the last step comes first
        scale = self._loss_scale()
        # The norm is a pass over every gradient: taken when clipping or the fp16 overflow check
        # needs it (as in the overlapped step, last_grad_norm is None otherwise).
        norm = self._grad_norm() / scale if self.config.gradient_clipping > 0 or self.config.fp16.enabled else None
        self.last_grad_norm = norm
        if not self.config.fp16.enabled and (norm is None or not math.isfinite(norm)):
            self._refuse_non_finite()  # before any unit is stepped (a finite norm says all are finite)
        self.global_steps += 1
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
        if norm is not None and self.config.gradient_clipping > 0 and norm > 0:
            clip = min(1.0, self.config.gradient_clipping / (norm + 1e-6))
        self._begin_optimizer_step()
        for i, unit in enumerate(self._trained):
            self._step_unit(i, unit, clip / scale, finite=norm is not None and math.isfinite(norm))
        self._close_step()
        self._log_and_schedule()

    def _begin_optimizer_step(self) -> None:
        """The update about to be built takes its learning rate from the client's scheduler,
        when one was given (read per step, as torch's optimizer reads its param groups)."""
        if self.lr_source is not None:
            self.optimizer.lr = self.lr_source.lr()
        self.optimizer.begin_step()

    def _queue_the_rest(self) -> None:
        """After an overlapped backward: queue the units backward did not hand over (resident
        ones, units that got no gradient), then wait for them all, or on one process let the
        next forward wait unit by unit (see [Note: the step's tail in the next forward])."""
        self.last_grad_norm = None
        for i in range(len(self._trained)):
            if self._stepper.future(i) is None:
                self._stepper.submit(i)
        self._tail_open = True
        # Several ranks wait (stages 1-2 gather the values after the step); so does a bad gradient.
        if self.ranks.world > 1 or any(u.grad is not None and u.grad.finite is False for u in self._trained):
            self.synchronize()  # (a non-finite gradient fails the step here, not at the next call)
        else:
            def forward_order(i: int) -> tuple[bool, int]:
                return not self._trained[i].persistent, self._trained[i].index

            left = self._stepper.reorder(key=forward_order)
            self.units_left_to_forward += len(left)
            # The next forward reads these values right after they are updated: keep them in RAM.
            self._keep_for_worker({i: n for n, i in enumerate(left)})
        self._log_and_schedule()

    def synchronize(self) -> None:
        """Wait for the optimizer work the last `step()` left running (see [Note: the step's
        tail in the next forward]); raises a unit's error if stepping it again fails too."""
        if not self._tail_open:
            return
        futures = self._stepper.take()
        self._tail_open = False  # if a retry raises, the step stays unfinished, as step() left it before
        for i, unit in enumerate(self._trained):
            self._settle_unit(i, unit, futures[i])
        self._close_step()

    def _close_step(self) -> None:
        """Every unit is stepped: the optimizer's step is complete, the gradients start over."""
        self.optimizer.finish_step()
        self._ranked.gather_values(self.store)
        self._zero_grads()

    def _log_and_schedule(self) -> None:
        if self.global_steps % self.config.steps_per_print == 0:
            p = self.coordinator.stats
            logger.info("step %d: lr %.3g, grad norm %s, prefetch hits %d, on demand %d, stall %.2f s",
                        self.global_steps, self.optimizer.lr,
                        "n/a" if self.last_grad_norm is None else f"{self.last_grad_norm:.4g}",
                        p.prefetch_hits, p.on_demand, p.stall_s)
        if self._schedule is not None:  # as DeepSpeed: the schedule advances on applied steps
            self._schedule_steps += 1
            self.optimizer.lr = self._schedule.lr_at(self._schedule_steps - 1)
        if self.lr_source is not None:
            self.lr_source.advance()
            self.optimizer.lr = self.lr_source.lr()

    def _refuse_after_partial_step(self) -> None:
        if self._partial_step:
            raise RuntimeError("the last step failed on a non-finite gradient after some units were updated "
                               "during backward (the optimizer overlapped it): load a checkpoint "
                               "(engine.load_checkpoint) to go on from a consistent state")

    def _refuse_non_finite(self) -> None:
        """Raise, with nothing changed, when a gradient of this step holds inf/nan (on any
        rank: every rank takes or refuses the step)."""
        bad = [u.key for u in self._trained if u.grad is not None and not u.grad.is_finite()]
        if self._ranked.sum_over_shards(float(len(bad)), "non-finite gradient count") > 0:
            raise ValueError(f"non-finite gradient values (inf/nan) in {', '.join(bad) or 'another rank'}: "
                             "the step was not taken, no parameter changed")

    def _grad_norm(self) -> float:
        """L2 norm over every unit's gradient buffer (sum of squares in float64; over every
        rank's shard when the gradients are partitioned)."""
        total = 0.0
        for u in self._trained:
            if u.grad is not None and u.grad.has_grad:
                with u.grad.read_pieces() as pieces:
                    total += sum(float(torch.linalg.vector_norm(g, dtype=torch.float32)) ** 2 for g in pieces)
        return math.sqrt(self._ranked.sum_over_shards(total, "gradient norm"))

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

    def named_parameters(self, select: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, a copy of its current values in the stored dtype) for the parameters
        `select` accepts (all without it), one unit at a time: at most one unit's values are
        held here, and a unit with no selected parameter is not read."""
        self._check_open()
        self.synchronize()
        self.coordinator.release_all()
        for unit in self.units:
            if select is None or any(select(s.name) for s in unit.slots):
                for name, values in _unit_values(self.store, unit, self._ranked):
                    if select is None or select(name):
                        yield name, values

    def stats(self) -> dict[str, Any]:
        """Store tiers and moves, prefetch counters, steps, and peak host memory (VmHWM)."""
        return {"store": self.store.stats(), "prefetch": asdict(self.coordinator.stats),
                "global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                "optimizer": {"overlap": self.overlap,
                              "units_stepped_in_backward": self.units_stepped_in_backward,
                              "units_left_to_forward": self.units_left_to_forward,
                              "forward_wait_s": self.optimizer_wait_s},
                "loss_scale": self._loss_scale() if self.config.fp16.enabled else None,
                "peak_rss_bytes": peak_rss_bytes()}

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """Save the store's moves and the engine's timeline as one Chrome / Perfetto trace."""
        self.store.write_trace(path)
        self.timeline.merge_into(path)

    # -- checkpoints (infinity/engine/_checkpoint.py) ------------------------------------------

    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None,
                        client_state: dict[str, Any] | None = None, *, async_save: bool = False,
                        async_budget_nbytes: int = ASYNC_SAVE_BUDGET_NBYTES,
                        update_latest: bool = True) -> Path:
        """Save everything needed to continue bit-identically as `tag` (default `step<N>`)
        under `save_dir`, crash-safe, and point `save_dir/latest` at it (not with
        `update_latest` false; docs/checkpoints.md). With async_save the last
        `async_budget_nbytes` of copies are written while training goes on; the next save,
        load or close() waits for it. Returns the tag's path."""
        self._check_open()
        self.wait_for_checkpoint()
        self.synchronize()
        self._pending_save = _checkpoint.save_checkpoint(
            self, save_dir, tag, client_state, update_latest=update_latest,
            async_budget_nbytes=async_budget_nbytes if async_save else None)
        return Path(save_dir) / (tag or f"step{self.global_steps}")

    def wait_for_checkpoint(self) -> None:
        """Wait for a background save; raise its error."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.result()

    def load_checkpoint(self, load_dir: str | os.PathLike[str], tag: str | None = None, *,
                        load_optimizer_states: bool = True,
                        values_only: bool = False) -> dict[str, Any]:
        """Restore a checkpoint (tag None: `load_dir/latest`); returns its client_state. With
        `values_only` only the parameters' values (fp32 ones: the optimizer's master)."""
        self._check_open()
        self.wait_for_checkpoint()
        self.synchronize()
        state = _checkpoint.load_checkpoint(self, load_dir, tag, values_only=values_only,
                                            load_optimizer_states=load_optimizer_states)
        self._zero_grads()  # what was accumulated belongs to the state before the load
        self._partial_step = False
        return state

    # -- end -------------------------------------------------------------------------------------

    def close(self, *, restore_params: bool = True) -> None:
        """Remove every hook and free the store. With restore_params the model gets its current
        values back as ordinary tensors (needs RAM for the whole model), else placeholders stay."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait_for_checkpoint()
            self.synchronize()
        finally:
            self._teardown(restore_params=restore_params)

    def _teardown(self, *, restore_params: bool) -> None:
        """Undo what __init__ did, as far as it got."""
        try:
            if self._stepper is not None:
                self._stepper.shutdown()
            self._stepping = self._tail_open = False
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


def _mmap_threshold(config: Config, plan: MemoryPlan) -> int | None:
    """`infinity.mmap_threshold` with "auto" decided: 1 MiB when anything lives on NVMe."""
    threshold = config.infinity.mmap_threshold
    if threshold != "auto":
        return threshold
    return 1 << 20 if plan.uses_nvme else None


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
