"""Engine: forward / backward / step of a model whose parameters, gradients and optimizer state
live in the tiered store (DeepSpeed's engine API, one process).

    engine = infinity.initialize(model, config)
    loss = engine(**batch).loss
    engine.backward(loss)
    engine.step()          # every micro-batch; updates at accumulation boundaries

Order of one step (at a boundary): release every unit (the values are about to change), global
gradient norm over the units' flat gradient buffers, fp16 overflow check (skip, lower the scale),
clip factor, one optimizer step over the units, zero the gradient buffers, LR schedule.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

import torch

from infinity.engine._host_adam import HostUnitAdam
from infinity.engine._plan import MemoryPlan, plan_memory
from infinity.engine._settings import Settings
from infinity.optim import DynamicLossScaler
from infinity.store import TensorStore, Tier
from infinity.zero import FetchUnit, ModelHooks, ParamCoordinator, place_units, plan_units

logger = logging.getLogger(__name__)


def _peak_rss_bytes() -> int:
    """VmHWM of this process (peak resident set), 0 where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Engine:
    """A model wrapped for training with ZeRO-3 style offload; build it with `infinity.initialize`.

    Attributes:
        module: the wrapped model (its parameters hold empty placeholders between uses).
        global_steps: optimizer steps taken (skipped fp16 steps included, as DeepSpeed counts).
        micro_steps: calls of `step()` (one per micro-batch).
    """

    def __init__(self, model: torch.nn.Module, settings: Settings, *, nvme_path: str | None = None) -> None:
        self.settings = settings
        self.module = model
        self.global_steps = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._closed = False
        accelerator = torch.cuda.is_available()
        self.device = torch.device("cuda", torch.cuda.current_device()) if accelerator else torch.device("cpu")
        if settings.fp16 or settings.bf16:
            model.to(torch.float16 if settings.fp16 else torch.bfloat16)
        model.to(self.device)
        # Below stage 3 nothing is partitioned: every parameter stays resident.
        persistence = settings.persistence_numel if settings.stage == 3 else 1 << 62
        self.units, uses = plan_units(model, persistence_numel=persistence)
        self.plan: MemoryPlan = plan_memory(
            self.units, offload_param=settings.offload_param if settings.stage == 3 else "none",
            offload_optimizer=settings.offload_optimizer, accelerator=accelerator,
            prefetch_numel=settings.prefetch_bucket_numel, tile_numel=settings.sub_group_size,
            host_memory_budget=settings.host_memory_budget)
        logger.info("engine: stage %d, params at home on %s, optimizer state %s; store budgets %s",
                    settings.stage, self.plan.param_home.label,
                    self.plan.state_tier.label if self.plan.state_tier else "in RAM",
                    {t.label: n for t, n in self.plan.budgets.items()})
        self.store = TensorStore(self.plan.budgets, nvme_path=nvme_path or settings.nvme_path, device=self.device)
        try:
            place_units(self.units, self.store, home=self.plan.param_home, device=self.device)
            self.coordinator = ParamCoordinator(
                self.units, self.store, fetch_tier=self.plan.fetch_tier, device=self.device,
                prefetch_numel=settings.prefetch_bucket_numel, max_live_numel=settings.max_live_numel,
                max_reuse_numel=settings.max_reuse_numel)
            self._hooks = ModelHooks(model, self.units, uses, self.coordinator)
            self._trained = [u for u in self.units if u.requires_grad]
            self.optimizer = self._make_optimizer()
        except BaseException:
            self.store.close()
            raise
        self.scaler = DynamicLossScaler(
            scale=2.0 ** settings.initial_scale_power, window=settings.loss_scale_window,
            hysteresis=settings.hysteresis, min_scale=settings.min_loss_scale) if settings.fp16 else None
        self.last_grad_norm: float | None = None

    def _make_optimizer(self):
        s = self.settings
        hyper = {"lr": s.lr, "betas": s.betas, "eps": s.eps, "weight_decay": s.weight_decay,
                 "adamw_mode": s.adamw_mode}
        if self.plan.state_tier is None:
            return HostUnitAdam(self._trained, self.store, **hyper)
        from infinity.optim import SwappedOptimizer, UnitSpec  # noqa: PLC0415
        specs = [UnitSpec(u.numel, u.dtype, u.key) for u in self._trained]
        return SwappedOptimizer.from_units(specs, self.store, tile_numel=s.sub_group_size,
                                           state_tier=self.plan.state_tier, **hyper)

    # -- training loop -------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model; returns what the model returns."""
        self._check_open()
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        """Backpropagate `loss` divided by gradient_accumulation_steps (times the fp16 loss
        scale); gradients land in the units' flat buffers. Returns `loss` unchanged."""
        self._check_open()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError("backward() needs a scalar loss tensor that requires grad, got "
                             f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
        scaled = loss
        if self.settings.gradient_accumulation_steps > 1:
            scaled = scaled / self.settings.gradient_accumulation_steps
        if self.scaler is not None:
            scaled = scaled * self.scaler.scale
        try:
            scaled.backward()
        finally:
            self.coordinator.end_backward()
        return loss

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.settings.gradient_accumulation_steps == 0

    def step(self) -> None:
        """Call after every backward; updates the parameters at accumulation boundaries."""
        self._check_open()
        if self.is_gradient_accumulation_boundary():
            self._take_step()
        self.micro_steps += 1

    def _take_step(self) -> None:
        self.coordinator.release_all()
        scale = self.scaler.scale if self.scaler is not None else 1.0
        norm = self._grad_norm() / scale
        self.last_grad_norm = norm
        if self.scaler is not None:
            overflow = not math.isfinite(norm)
            self.scaler.update(overflow)
            if overflow:
                logger.info("step %d skipped: gradient overflow, loss scale now %g",
                            self.global_steps + 1, self.scaler.scale)
                self.skipped_steps += 1
                self.global_steps += 1
                self._zero_grads()
                return
        clip = 1.0
        if self.settings.gradient_clipping > 0 and norm > 0:
            clip = min(1.0, self.settings.gradient_clipping / (norm + 1e-6))
        self.optimizer.begin_step()
        for i, unit in enumerate(self._trained):
            grad = unit.grad if unit.grad is not None else torch.zeros(unit.numel, dtype=unit.dtype)
            self.optimizer.step_unit(i, grad, grad_scale=clip / scale)
        self.optimizer.finish_step()
        self._zero_grads()
        self.global_steps += 1

    def _grad_norm(self) -> float:
        """L2 norm over every unit's gradient buffer (sum of squares in float64)."""
        total = 0.0
        for u in self._trained:
            if u.has_grad:
                total += float(torch.linalg.vector_norm(u.grad, dtype=torch.float32)) ** 2
        return math.sqrt(total)

    def _zero_grads(self) -> None:
        for u in self._trained:
            u.zero_grad()

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
            yield from _unit_values(self.store, unit)

    def stats(self) -> dict[str, Any]:
        """Store tiers and moves, prefetch counters, steps, and peak host memory (VmHWM)."""
        return {"store": self.store.stats(), "prefetch": asdict(self.coordinator.stats),
                "global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                "loss_scale": self.scaler.scale if self.scaler is not None else None,
                "peak_rss_bytes": _peak_rss_bytes()}

    def write_trace(self, path: str | os.PathLike[str]) -> None:
        """Save the store's moves as a Chrome / Perfetto trace."""
        self.store.write_trace(path)

    # -- end -------------------------------------------------------------------------------------

    def close(self, *, restore_params: bool = True) -> None:
        """Remove every hook and free the store. With restore_params the model gets its current
        values back as ordinary tensors (needs RAM for the whole model), else placeholders stay."""
        if self._closed:
            return
        self._closed = True
        try:
            self.coordinator.release_all()
            self._hooks.remove()
            if restore_params:
                for unit in self.units:
                    values = dict(_unit_values(self.store, unit))
                    for s in unit.slots:
                        s.param.data = values[s.name].to(self.device)
        finally:
            self.store.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is closed")


def _unit_values(store: TensorStore, unit: FetchUnit) -> Iterator[tuple[str, torch.Tensor]]:
    flat = store.fetch(unit.key, Tier.HOST).result()
    try:
        copies = [(s.name, flat[s.offset:s.offset + s.shape.numel()].view(s.shape).clone()) for s in unit.slots]
    finally:
        store.release(unit.key, Tier.HOST)
    yield from copies
