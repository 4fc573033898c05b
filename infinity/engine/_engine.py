"""Engine: forward / backward / step of a model whose parameters, gradients and optimizer state
live in the tiered store (DeepSpeed's engine API), on one process or on data-parallel ranks
(torchrun; what each ZeRO stage partitions is in infinity/engine/_partition.py).

    engine = infinity.initialize(model, config)
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()          # every micro-batch; updates at accumulation boundaries

Order of one step (at a boundary): release every unit (the values are about to change), global
gradient norm over the units' flat gradient buffers, fp16 overflow check (skip, lower the scale),
clip factor (those checks: infinity/engine/_grad_checks.py), one optimizer step over the
units, zero the gradient buffers, LR schedule (all of which OptimizerStep does,
infinity/engine/_optimizer_step.py). The step's phase (`engine.phase`,
infinity/engine/_step_state.py) says where the step is; the engine moves it.

The optimizer overlapped with backward, and the tail of its step that runs into the next
forward: [Note: optimizer overlapped with backward] and [Note: the step's tail in the next
forward] in infinity/engine/_overlap.py.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from infinity.config import AdamParams, Config, OptimizerConfig
from infinity.engine import _checkpoint
from infinity.engine._client import LRSource
from infinity.engine._grad_checks import global_norm, grad_square
from infinity.engine._optimizer_step import OptimizerStep
from infinity.engine._overlap import OverlappedStep, StepUndoError
from infinity.engine._partition import RankedUnits
from infinity.engine._placement import (
    choose_model_precision,
    lay_out,
    open_store,
    optimizer_overlaps,
    state_format,
    take_placed,
)
from infinity.engine._plan import MemoryPlan
from infinity.engine._schedule import build_lr_schedule
from infinity.engine._step_state import StepCounters, StepPhase, check_move
from infinity.engine._timeline import Timeline
from infinity.errors import ClosedError, ConfigError, NonFiniteGradientError
from infinity.memory import MAX_MMAP_THRESHOLD, peak_rss_bytes, set_mmap_threshold
from infinity.optim import DynamicLossScaler, SwappedOptimizer
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
        module: the wrapped model (its parameters hold empty placeholders between uses, unless
            every unit is resident: offload_param none on one process, see `keeps_units_resident`).
        phase: where the optimizer step is (StepPhase; docs/engine.md, "The step's phases").
        counters: the step counts (StepCounters); `global_steps` (optimizer steps taken, skipped
            fp16 steps included, as DeepSpeed counts), `micro_steps` (calls of `step()`) and
            `skipped_steps` read them.
        last_grad_norm: the global gradient norm of the last step (unscaled; None before one).
    """

    def __init__(self, model: torch.nn.Module, config: Config) -> None:
        self.config = config
        self.module = model
        self.counters = StepCounters()
        self.phase = StepPhase.IDLE
        self._owner = os.getpid()  # a forked child inherits the engine, not its threads
        zero = config.zero_optimization
        adam = (config.optimizer or _DEFAULT_OPTIMIZER).params
        schedule = None if config.scheduler is None else \
            build_lr_schedule(config.scheduler, optimizer_lr=adam.lr)  # its errors come first
        self.ranks = Ranks.from_environment(timeout_s=config.infinity.collective_timeout)
        if self.ranks.world != config.world_size:
            raise ConfigError(f"the config was loaded for world_size {config.world_size} but this "
                              f"job has {self.ranks.world} ranks: load it with load_config(..., "
                              f"world_size={self.ranks.world}) or use infinity.initialize")
        self.partition = Partition(self.ranks, zero.stage)
        self.precision, self.device = choose_model_precision(config)
        # see [Note: placed models]
        placed = take_placed(model, config, self.precision, self.device,
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
        threshold = _mmap_threshold(config, self.plan, self.precision.compute)
        if threshold is not None:
            set_mmap_threshold(threshold)
        # its errors before anything is opened
        self.overlap = optimizer_overlaps(config, self.device)
        self.ranks.check_same(_fingerprint(config, self.units), "the config or the model's layout")
        self.store = (open_store(layout, config, rank=self.ranks.rank) if placed is None
                      else placed.store)
        # On the store's clock: a loaded model's store is older than the engine by the load.
        self.timeline = Timeline(self.store.moves.t0)
        self.coordinator: ParamCoordinator | None = None
        self._hooks: ModelHooks | None = None
        self._stepper: OverlappedStep | None = None  # the overlapped step, when overlapping
        # the optimizer's read ahead (no thread until the first; OptimizerStep.prefetch_state)
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="infinity-read-ahead")
        self.ranked = RankedUnits(self.partition, [u for u in self.units if u.requires_grad])
        try:
            partition = self.partition if self.ranks.world > 1 else None
            if deferred:  # see [Note: deferred parameters]
                create_units(model, self.units, self.store, home=self.plan.param_home,
                             device=self.device, partition=partition)
            elif placed is None:
                place_units(self.units, self.store, home=self.plan.param_home, device=self.device,
                            partition=partition)
            for u in self.ranked.trained:  # in RAM unless the budget cannot hold them there
                u.grad = self.ranked.make_grad(u, self.store, self.plan.grads_tier)
            self.coordinator = ParamCoordinator(
                self.units, self.store, fetch_tier=self.plan.fetch_tier, device=self.device,
                prefetch_numel=self.plan.prefetch_numel,
                max_live_numel=zero.stage3_max_live_parameters,
                max_reuse_numel=zero.stage3_max_reuse_distance, on_grads_final=self._grads_final,
                gather=self.ranks if self.partition.params else None, ready=self._unit_ready)
            self._hooks = ModelHooks(model, self.units, uses, self.coordinator)
            self.optimizer = self._make_optimizer()
        except BaseException:
            # The model gets back what was moved; not gathered from the ranks, which may be
            # elsewhere (a rank-local failure), so stage 3 on several ranks leaves placeholders.
            self._teardown(restore_params=not self.partition.params)
            raise
        self._steps = OptimizerStep(config, self.ranked, self.optimizer, self.store,
                                    self.coordinator, self.timeline, schedule, self._reader)
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary
        if self.overlap:
            steps = self._steps
            self._stepper = OverlappedStep(
                self.ranked.trained, steps.step_at, steps.settle, steps.prefetch_state,
                self.coordinator.next_use,
                always_speculate=self.config.infinity.speculate == "always")
        self._pending_save: Future[Path] | None = None  # a background checkpoint save

    def _make_optimizer(self) -> SwappedOptimizer:
        """Per-unit CPU Adam with its state in the store's host tier (offload_optimizer "none"
        or "cpu") or NVMe tier."""
        opt = self.config.optimizer or _DEFAULT_OPTIMIZER
        p = opt.params
        hyper = {"lr": p.lr, "betas": p.betas, "eps": p.eps, "weight_decay": p.weight_decay,
                 "adamw_mode": opt.decoupled_weight_decay}
        specs = self.ranked.optimizer_specs
        # What one unit's step fetches from the store: its tiles, its values, a gradient kept there.
        stored_grad = self.plan.grads_tier is not None
        self.coordinator.next_use.set_step_fetches({
            self.ranked.trained[i].key: -(-spec.numel // self.plan.tile_numel) + 1 + stored_grad
            for i, spec in specs.items()})
        return SwappedOptimizer(list(specs.values()), self.store, state_tier=self.plan.state_tier,
                                tile_numel=self.plan.tile_numel,
                                state_format=state_format(self.config), **hyper)

    @property
    def global_steps(self) -> int:
        return self.counters.global_steps

    @property
    def micro_steps(self) -> int:
        return self.counters.micro_steps

    @property
    def skipped_steps(self) -> int:
        return self.counters.skipped_steps

    @property
    def last_grad_norm(self) -> float | None:
        return self._steps.last_grad_norm

    @property
    def scaler(self) -> DynamicLossScaler | None:
        """The fp16 dynamic loss scaler (None unless fp16 with a dynamic scale)."""
        return self._steps.scaler

    @property
    def lr_source(self) -> LRSource | None:
        """A client's scheduler (infinity/engine/_client.py), when one drives the lr."""
        return self._steps.lr_source

    @lr_source.setter
    def lr_source(self, source: LRSource | None) -> None:
        self._steps.lr_source = source

    @property
    def units_stepped_in_backward(self) -> int:
        return 0 if self._stepper is None else self._stepper.stepped_in_backward

    # -- training loop -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model; returns what the model returns. The first batch decides batch sizes
        the config left to it ("auto"): the first dimension of the first tensor argument."""
        self._check_open()
        if self.config.batch_pending:
            first = next((a for a in (*args, *kwargs.values())
                          if isinstance(a, torch.Tensor) and a.dim()), None)
            if first is not None:
                self.config = self.config.with_micro_batch(int(first.shape[0]))
                logger.info("batch sizes from the first batch: micro %d, train %d",
                            self.config.train_micro_batch_size_per_gpu,
                            self.config.train_batch_size)
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
        if self.phase is StepPhase.STEPPING:
            raise RuntimeError("backward() twice in one accumulation boundary: call step() first")
        self._refuse_if_broken()
        self.synchronize()  # gradients accumulate again only once every unit was stepped
        scaled = loss
        if scale_wrt_gas and self.config.gradient_accumulation_steps > 1:
            scaled = scaled / self.config.gradient_accumulation_steps
        if self.config.fp16.enabled:
            scaled = scaled * self._steps.loss_scale()
        boundary = self.is_gradient_accumulation_boundary()
        for u in self.ranked.trained:  # inf/nan survive the sums: checked once, at the boundary
            if u.grad is not None:
                u.grad.check_now = boundary
        if self._stepper is not None and boundary:
            self._steps.begin()
            self._stepper.begin(self.optimizer.lr, grad_scale=1.0 / self._steps.loss_scale())
            self._move(StepPhase.STEPPING)
        try:
            with self.timeline.region("backward", "compute"):
                scaled.backward()
        finally:
            self.coordinator.end_backward()
        return loss

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last step (DeepSpeed's engine.zero_grad;
        `step()` does it itself): e.g. to skip a batch whose step failed on a non-finite
        gradient, which changed nothing. Counters are kept."""
        self._check_open()
        if self.phase is StepPhase.STEPPING:
            raise RuntimeError("zero_grad() between a boundary backward and its step(): "
                               "call step() first")
        self.synchronize()
        self._steps.zero_grads()

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary is not None:
            return self._boundary
        return (self.counters.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Say whether the next backward and step end an accumulation (DeepSpeed's method: a
        loop whose last accumulation of an epoch is short sets it per micro-batch); None goes
        back to counting micro-batches."""
        self._boundary = is_boundary

    def step(self) -> None:
        """Call after every backward; updates the parameters at accumulation boundaries. A step
        refused for a non-finite gradient (NonFiniteGradientError) ends its accumulation all
        the same: after `zero_grad()` the next micro-batch starts a new one."""
        self._check_open()
        self._refuse_if_broken()
        if self.is_gradient_accumulation_boundary():
            try:
                with self.timeline.region("step", "compute"):
                    self.coordinator.release_all()
                    self.ranked.average_rest()
                    if self.phase is StepPhase.STEPPING:
                        self._end_overlapped_step()
                    else:  # (step() twice without a backward between: the last step first)
                        self.synchronize()
                        self._step_after_backward()
            except NonFiniteGradientError:
                self.counters.micro_steps += 1  # as a skipped fp16 step's, its window is over
                raise
        self.counters.micro_steps += 1

    def synchronize(self) -> None:
        """Wait for the optimizer work the last `step()` left running (see [Note: the step's
        tail in the next forward]); raises a unit's error if stepping it again fails too."""
        if self._stepper is None or not self._stepper.tail_open:
            return
        try:
            self._stepper.settle()
        finally:  # settled; or an error left the step unfinished, as a failed step() does
            if self.phase is StepPhase.TAIL_OPEN:
                self._move(StepPhase.IDLE)
        self._steps.close()

    # -- the step --------------------------------------------------------------------------------

    def _step_after_backward(self) -> None:
        """step() after a backward that stepped nothing: validate, then step every unit
        (OptimizerStep.after_backward), the phase VALIDATING meanwhile."""
        self._move(StepPhase.VALIDATING)
        try:
            self._steps.after_backward(self.counters)
        finally:
            self._move(StepPhase.IDLE)

    def _end_overlapped_step(self) -> None:
        """step() after an overlapped backward: validate the speculated units (see [Note:
        speculate, then validate] in infinity/engine/_overlap.py); queue the units not stepped
        yet, then wait for them all, or on one process let the next forward wait unit by unit
        (see [Note: the step's tail in the next forward])."""
        self._move(StepPhase.VALIDATING)
        stepper = self._stepper
        try:
            decided = stepper.decide(
                lambda i: grad_square(self.ranked.trained[i]),
                lambda squares, undo: self._steps.validate(global_norm(self.ranked, squares),
                                                           self.counters, undo))
        except StepUndoError:
            self._move(StepPhase.BROKEN)
            raise
        except BaseException:  # refused (NonFiniteGradientError), or failed and rolled back
            self._move(StepPhase.IDLE)
            raise
        if decided is None:  # skipped (fp16 overflow): nothing changed
            self._move(StepPhase.IDLE)
            return
        grad_scale, committed = decided
        self._move(StepPhase.TAIL_OPEN)
        stepper.queue_rest(grad_scale, committed)
        trained = self.ranked.trained
        if self.ranks.world > 1:  # stages 1-2 gather the values after the step
            self.synchronize()
        else:
            def forward_order(i: int) -> tuple[bool, int]:
                return not trained[i].persistent, trained[i].index

            self._stepper.leave_to_forward(forward_order)
        self._steps.log_and_schedule(self.counters)

    def _grads_final(self, unit: FetchUnit) -> None:
        """Coordinator callback: average the unit's gradient over the ranks at the boundary
        (stages 0-1); when overlapping, take its square and start its optimizer step."""
        self.timeline.record(unit.key, "grads final", time.perf_counter())
        i = self.ranked.index.get(unit)
        if i is None:  # frozen
            return
        if self.is_gradient_accumulation_boundary():
            self.ranked.average(i)
        if self.phase is StepPhase.STEPPING:
            released = not unit.persistent and unit.state is UnitState.RELEASED
            self._stepper.grads_final(i, grad_square(unit), hand_over=released)

    def _unit_ready(self, unit: FetchUnit, wait: bool) -> bool:
        """Coordinator callback before it fetches a unit's values: False while the last step's
        tail is still stepping the unit; with `wait`, wait for that (stepping it here if it
        failed on the worker) and return True. See [Note: the step's tail in the next forward]."""
        i = self.ranked.index.get(unit)
        if self._stepper is None or i is None:
            return True
        return self._stepper.ready(i, wait)

    def _refuse_if_broken(self) -> None:
        if self.phase is StepPhase.BROKEN:
            raise RuntimeError("the engine is broken: the last step could not undo the units it "
                               "had stepped during backward (a rollback failed), so the state is "
                               "half a step; load a checkpoint (engine.load_checkpoint) to go on "
                               "from a consistent state")

    def _move(self, to: StepPhase) -> None:
        self.phase = check_move(self.phase, to)

    # -- modes and views -------------------------------------------------------------------------

    def train(self, mode: bool = True) -> Engine:
        self.module.train(mode)
        return self

    def eval(self) -> Engine:
        return self.train(False)

    def get_lr(self) -> list[float]:
        return [float(self.optimizer.lr)]

    def named_parameters(self, select: Callable[[str], bool] | None = None
                         ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, a copy of its current values in the stored dtype) for the parameters
        `select` accepts (all without it), one unit at a time: at most one unit's values are
        held here, and a unit with no selected parameter is not read."""
        for unit in self._units_to_read(select):
            yield from [(name, values.clone())
                        for name, values in self.ranked.unit_values(self.store, unit)
                        if select is None or select(name)]

    def parameter_views(self, select: Callable[[str], bool] | None = None
                        ) -> Iterator[tuple[str, torch.Tensor]]:
        """As `named_parameters`, without the copies: views of the store's copy, valid until
        the next item is taken (its unit is held meanwhile), for a writer that stores each
        before taking the next (a streamed save). Every rank takes every item (stage 3 gathers
        each unit)."""
        for unit in self._units_to_read(select):
            for name, values in self.ranked.unit_values(self.store, unit):
                if select is None or select(name):
                    yield name, values

    def _units_to_read(self, select: Callable[[str], bool] | None) -> list[FetchUnit]:
        """The units holding a parameter `select` accepts, once the last step is done and no
        unit is in use."""
        self._check_open()
        self.synchronize()
        self.coordinator.release_all()
        return [u for u in self.units if select is None or any(select(s.name) for s in u.slots)]

    def stats(self) -> dict[str, Any]:
        """Store tiers and moves, prefetch counters, steps, the optimizer state's format and
        real bytes (this rank's), and peak host memory (VmHWM)."""
        stepper = self._stepper
        optimizer = self.optimizer
        stepped = sum(u.numel for u in optimizer.units)
        overlapped = {"units_stepped_in_backward": self.units_stepped_in_backward,
                      "units_left_to_forward": 0 if stepper is None else stepper.left_to_forward,
                      "forward_wait_s": 0.0 if stepper is None else stepper.forward_wait_s,
                      "units_speculated": 0 if stepper is None else stepper.units_speculated,
                      "rollbacks": 0 if stepper is None else stepper.rollbacks,
                      "units_rolled_back": 0 if stepper is None else stepper.units_rolled_back,
                      "steps_not_speculated":
                          0 if stepper is None else stepper.steps_not_speculated}
        upcasts = self.coordinator.upcasts
        return {"store": self.store.stats(),
                "prefetch": {**asdict(self.coordinator.stats), "upcasts_reused": upcasts.reused,
                             "upcasts_fresh": upcasts.fresh},
                "global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                "optimizer": {"overlap": self.overlap, **overlapped,
                              "state_format": dataclasses.asdict(optimizer.state_format),
                              "state_bytes": optimizer.state_nbytes,
                              "state_bytes_per_param": optimizer.state_nbytes / stepped},
                "loss_scale": self._steps.loss_scale() if self.config.fp16.enabled else None,
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
        if self.phase is StepPhase.STEPPING:
            raise RuntimeError("save_checkpoint() between a boundary backward and its step(): "
                               "call step() first")
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
        `values_only` only the parameters' values (fp32 ones: the optimizer's master). After a
        broken step it is the way on: the worker's work is waited for, nothing retried."""
        self._check_open()
        self.wait_for_checkpoint()
        if self.phase is StepPhase.BROKEN:
            self._stepper.drain()
        else:
            self.synchronize()
        state = _checkpoint.load_checkpoint(self, load_dir, tag, values_only=values_only,
                                            load_optimizer_states=load_optimizer_states)
        self._steps.zero_grads()  # what was accumulated belongs to the state before the load
        if self.phase is StepPhase.BROKEN:
            self._move(StepPhase.IDLE)
        return state

    # -- end -------------------------------------------------------------------------------------

    def close(self, *, restore_params: bool = True) -> None:
        """Remove every hook and free the store. With restore_params the model gets its current
        values back as ordinary tensors (needs RAM for the whole model), else placeholders stay.
        In a process forked from the owner it does nothing: the engine is the parent's."""
        if self.phase is StepPhase.CLOSED or os.getpid() != self._owner:
            return
        try:
            self.wait_for_checkpoint()
            self.synchronize()
        finally:
            self._move(StepPhase.CLOSED)
            self._teardown(restore_params=restore_params)

    def _teardown(self, *, restore_params: bool) -> None:
        """Undo what __init__ did, as far as it got."""
        try:
            if self._stepper is not None:
                self._stepper.shutdown()
            self._reader.shutdown(wait=True, cancel_futures=True)  # hints not started yet go
            if self.coordinator is not None:
                self.coordinator.abort_pass()  # a failed forward may have left modules in use
                self.coordinator.release_all()
                self.coordinator.upcasts.clear()  # up to two of the largest units' copies
            if self._hooks is not None:
                self._hooks.remove()
            if restore_params and not self.ranks.failed:
                for unit in self.units:
                    if unit.key in self.store:
                        values = {name: v.to(self.device, unit.compute_dtype, copy=True)
                                  for name, v in self.ranked.unit_values(self.store, unit)}
                        for s in unit.slots:
                            s.param.data = values[s.name]
        finally:
            self.store.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if os.getpid() != self._owner:
            raise ClosedError(f"this engine belongs to process {self._owner}: a process forked "
                              "from it has none of its threads; initialize a new one here")
        if self.phase is StepPhase.CLOSED:
            raise ClosedError("the engine is closed")


def _mmap_threshold(config: Config, plan: MemoryPlan, compute: torch.dtype) -> int | None:
    """`infinity.mmap_threshold` with "auto" decided: when anything lives on NVMe, 8 MiB for a
    model that computes in 16 bits, glibc's ceiling (32 MiB) for one that computes in fp32
    (infinity/memory/malloc.py says why)."""
    threshold = config.infinity.mmap_threshold
    if threshold != "auto":
        return threshold
    if not plan.uses_nvme:
        return None
    return 8 << 20 if compute.itemsize == 2 else MAX_MMAP_THRESHOLD


def _fingerprint(config: Config, units: list[FetchUnit]) -> str:
    """What every rank must agree on: the config (less what each machine fills in, such as the
    host memory budget) and the model's units."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
              if f.name not in ("infinity", "auto_filled")}
    layout = [(u.key, u.numel, str(u.dtype), u.requires_grad) for u in units]
    return repr((sorted(fields.items()), config.infinity.compute_dtype, layout))
