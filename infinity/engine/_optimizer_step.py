"""What every optimizer step of the engine does, overlapped with backward or not: the rule that
decides it from the global norm (`validate`), a unit's step (`step_unit`), closing it, the step
after backward whole (`after_backward`), and the bookkeeping around it (loss scale, learning
rate from the schedule or a client's scheduler, the log line). The engine keeps the step's phase
and its moves; `OverlappedStep` (infinity/engine/_overlap.py) runs the speculated step through
`step_at`, `settle` and `prefetch_state`, and decides it with `validate`."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from concurrent.futures import Executor

import torch

from infinity.config import Config
from infinity.engine._client import LRSource
from infinity.engine._grad_checks import clip_factor, global_norm, grad_square, refuse_non_finite
from infinity.engine._partition import RankedUnits
from infinity.engine._step_state import StepCounters
from infinity.engine._timeline import Timeline
from infinity.errors import NonFiniteGradientError
from infinity.optim import DynamicLossScaler, LRSchedule, SwappedOptimizer
from infinity.store import TensorStore
from infinity.zero import FetchUnit, ParamCoordinator
from infinity.zero.grads import pieces_are_finite

logger = logging.getLogger(__name__)


class OptimizerStep:
    """The optimizer step over the trained units, with its loss scale and learning rate.

    Attributes:
        scaler: the fp16 dynamic loss scaler (None unless fp16 with a dynamic scale).
        lr_source: a client's scheduler (infinity/engine/_client.py), set after construction;
            read per step, and advanced after each applied one.
        last_grad_norm: the global gradient norm of the last step (unscaled; None before one,
            or where the step took none).
    """

    def __init__(self, config: Config, ranked: RankedUnits, optimizer: SwappedOptimizer,
                 store: TensorStore, coordinator: ParamCoordinator, timeline: Timeline,
                 schedule: LRSchedule | None, reader: Executor) -> None:
        # Only the settings no later batch changes are read: clipping, fp16, steps_per_print.
        self._config = config
        self._ranked = ranked
        self._optimizer = optimizer
        self._store = store  # stages 1-2 gather the stepped values through it
        self._coordinator = coordinator  # its prefetch counters go into the log line
        self._timeline = timeline
        self._schedule = schedule
        self._reader = reader  # runs prefetch_state's reads: see [Note: reading ahead off the path]
        fp16 = config.fp16
        self.scaler = DynamicLossScaler(
            scale=fp16.initial_scale, window=fp16.loss_scale_window, hysteresis=fp16.hysteresis,
            min_scale=fp16.min_loss_scale) if fp16.enabled and fp16.dynamic else None
        self._static_scale = fp16.initial_scale if fp16.enabled and not fp16.dynamic else 1.0
        if schedule is not None:
            optimizer.lr = schedule.lr_at(-1)
        self.lr_source: LRSource | None = None
        self.last_grad_norm: float | None = None

    @property
    def needs_norm(self) -> bool:
        """Whether the step after backward takes the global norm: for clipping and the fp16
        overflow check (overlapped, every step takes it as the gradients become final)."""
        return self._config.gradient_clipping > 0 or self._config.fp16.enabled

    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else self._static_scale

    def after_backward(self, counters: StepCounters) -> None:
        """Every gradient is final: the global norm and finiteness decide the step, then every
        unit is stepped (all or nothing: a refused step changes nothing, step count included)."""
        # The norm is a pass over every gradient: taken where needed (last_grad_norm is None
        # otherwise).
        norm = None
        if self.needs_norm:
            norm = global_norm(self._ranked, [grad_square(u) for u in self._ranked.trained])
        grad_scale = self.validate(norm, counters)
        if grad_scale is None:
            return
        self.begin()
        finite = norm is not None and math.isfinite(norm)
        trained = self._ranked.trained
        for i, unit in enumerate(trained):
            if i + 1 < len(trained):  # its reads overlap this unit's update
                self.prefetch_state(i + 1)
            self.step_unit(i, unit, grad_scale, finite=finite)
        self.close()
        self.log_and_schedule(counters)

    def begin(self) -> None:
        """The update about to be built takes its learning rate from the client's scheduler,
        when one was given (read per step, as torch's optimizer reads its param groups)."""
        if self.lr_source is not None:
            self._optimizer.lr = self.lr_source.lr()
        self._optimizer.begin_step()

    def validate(self, norm: float | None, counters: StepCounters,
                 undo: Callable[[], None] = lambda: None) -> float | None:
        """Decide the step from the global norm (of the scaled gradients; None: not taken):
        returns its gradient scale (clip factor / loss scale), or None for an fp16 step skipped
        on an overflow; raises NonFiniteGradientError for a refused step. `undo()` (the
        speculated units rolled back) runs before a step is refused or skipped, so either
        changes nothing."""
        scale = self.loss_scale()
        norm = None if norm is None else norm / scale
        self.last_grad_norm = norm
        if not self._config.fp16.enabled and (norm is None or not math.isfinite(norm)):
            try:  # before any unit is stepped (a finite norm says all are finite)
                refuse_non_finite(self._ranked)
            except NonFiniteGradientError:
                undo()
                raise
        counters.global_steps += 1
        if self._config.fp16.enabled:
            overflow = not math.isfinite(norm)
            if self.scaler is not None:
                self.scaler.update(overflow)
            if overflow:
                undo()
                logger.info("step %d skipped: gradient overflow, loss scale now %g",
                            counters.global_steps, self.loss_scale())
                counters.skipped_steps += 1
                self.zero_grads()
                return None
        return clip_factor(norm, self._config.gradient_clipping) / scale

    def step_at(self, i: int, lr: float, grad_scale: float, speculative: bool) -> bool:
        """Step trained unit i for the overlapped step (its learning rate and gradient scale):
        speculatively during backward, else once the step was validated (its gradient known
        finite). False: a speculative step found no room to keep the old state (nothing
        changed)."""
        return self.step_unit(i, self._ranked.trained[i], grad_scale, lr=lr,
                              speculative=speculative, finite=not speculative)

    def settle(self, i: int, commit: bool) -> None:
        """Commit or roll back the speculative step of trained unit i (this rank's part)."""
        j = self._ranked.optimizer_index.get(i)
        if j is not None:
            (self._optimizer.commit_unit if commit else self._optimizer.rollback_unit)(j)

    def prefetch_state(self, i: int) -> None:
        """Start reading what stepping trained unit i reads first (its gradient where it is
        stored, its values and first tile) on the reader, without waiting (a hint).

        [Note: reading ahead off the path] Starting a read may wait for room: a full host tier
        waits for the last unit's write-backs. Whoever asks (the worker before a unit's update,
        the step after backward, the thread that queues units) goes on meanwhile, so the reads
        of the next unit overlap the writes of the last; inline, the 7 B tail's worker spent
        36% of its time there and the disk read only once the writes were out. A read ahead
        that fails is logged at debug level: the step reads what it needs itself; one that
        starts after its step was done reads nothing."""
        self._reader.submit(self._read_ahead, i, self._optimizer.completed_steps)

    def _read_ahead(self, i: int, completed: int) -> None:
        if self._optimizer.completed_steps != completed:
            return  # the step it was for is done
        try:
            j = self._ranked.optimizer_index.get(i)
            if j is not None:  # this rank steps part of the unit
                grad = self._ranked.trained[i].grad
                if grad is not None:
                    grad.read_ahead()
                self._optimizer.prefetch_unit(j)
        except Exception as exc:  # noqa: BLE001 - a hint: the step reads what it needs itself
            logger.debug("read ahead of trained unit %d failed: %s", i, exc)

    def step_unit(self, i: int, unit: FetchUnit, grad_scale: float, *, finite: bool = False,
                  lr: float | None = None, speculative: bool = False) -> bool:
        """Step unit i; `finite`: its gradient is known to be free of inf/nan (a finite norm);
        `lr`: the step's learning rate (default: the optimizer's); `speculative`: to be
        committed or rolled back, its gradient kept for a redo when clipping may ask for one.
        Returns what SwappedOptimizer.step_unit returns."""
        j = self._ranked.optimizer_index.get(i)
        if j is None:  # this rank steps no element of the unit
            return True
        with self._timeline.region(unit.key, "optimizer"):
            if speculative and not self._optimizer.keep_unit(j):
                return False  # no room to keep its state: nothing read, not even the gradient
            if unit.grad is None:
                return self._optimizer.step_unit(
                    j, torch.zeros(unit.numel, dtype=unit.compute_dtype), grad_scale=grad_scale,
                    lr=lr, speculative=speculative)
            with unit.grad.read_pieces() as pieces:
                # Speculated: not stepped (the validation refuses the step, rolling back the
                # units speculated before it).
                if not finite and (unit.grad.finite is False or
                                   unit.grad.finite is None and not pieces_are_finite(pieces)):
                    raise NonFiniteGradientError(
                        f"the gradient of {unit.key} has non-finite values (inf/nan): the unit "
                        f"was not stepped")
                stepped = self._optimizer.step_unit(
                    j, self._ranked.grad_part(i, pieces), grad_scale=grad_scale,
                    check_finite=False, lr=lr, speculative=speculative)
            if stepped and not (speculative and self._config.gradient_clipping > 0):
                unit.grad.zero()  # used up (no redo): a gradient in RAM is freed while others step
            return stepped

    def close(self) -> None:
        """Every unit is stepped: the optimizer's step is complete, the gradients start over."""
        self._optimizer.finish_step()
        self._ranked.gather_values(self._store)
        self.zero_grads()

    def log_and_schedule(self, counters: StepCounters) -> None:
        """After an applied step: the log line every steps_per_print steps, then the learning
        rate of the next step (as DeepSpeed, the schedule advances on applied steps)."""
        if counters.global_steps % self._config.steps_per_print == 0:
            p = self._coordinator.stats
            logger.info("step %d: lr %.3g, grad norm %s, prefetch hits %d, on demand %d, "
                        "stall %.2f s",
                        counters.global_steps, self._optimizer.lr,
                        "n/a" if self.last_grad_norm is None else f"{self.last_grad_norm:.4g}",
                        p.prefetch_hits, p.on_demand, p.stall_s)
        if self._schedule is not None:
            counters.schedule_steps += 1
            self._optimizer.lr = self._schedule.lr_at(counters.schedule_steps - 1)
        if self.lr_source is not None:
            self.lr_source.advance()
            self._optimizer.lr = self.lr_source.lr()

    def zero_grads(self) -> None:
        self._ranked.new_step()
        for u in self._ranked.trained:
            if u.grad is not None:
                u.grad.zero()
