"""`DeepSpeedEngine`: Infinity's engine with DeepSpeed's engine methods and their meanings (what
`infinity.deepspeed.initialize` returns). Only what differs from `infinity.Engine` is here."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from infinity.checkpoint import latest_tag
from infinity.config import Config
from infinity.deepspeed._optimizer import ConfigSchedule, EngineOptimizer, GroupsLR
from infinity.deepspeed._torch_save import save_streamed
from infinity.engine import Engine

logger = logging.getLogger(__name__)

STATE_KEY = "infinity.deepspeed"  # in a checkpoint's client_state: the client scheduler's state


class DeepSpeedEngine(Engine):
    """Build it with `infinity.deepspeed.initialize`. Attributes besides `infinity.Engine`'s:
    `client_optimizer` (the `EngineOptimizer`), `lr_scheduler` (the client's scheduler, or a view
    of the config's), `training_dataloader` (or None). Attributes it does not have are looked up
    on the module, as DeepSpeed's engine does."""

    def __init__(self, model: torch.nn.Module, config: Config) -> None:
        super().__init__(model, config)
        self.client_optimizer: EngineOptimizer | None = None
        self.lr_scheduler: Any = None
        self.training_dataloader: torch.utils.data.DataLoader | None = None
        self._step_applied = False

    def __getattr__(self, name: str) -> Any:
        module = self.__dict__.get("module")
        if module is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(module, name)

    # -- configuration, as DeepSpeed's methods --------------------------------------------------

    def train_micro_batch_size_per_gpu(self) -> int | None:
        return self.config.train_micro_batch_size_per_gpu

    def train_batch_size(self) -> int | None:
        return self.config.train_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    @property
    def global_samples(self) -> int:
        return self.global_steps * (self.config.train_batch_size or 0)

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group (of the next update)."""
        groups = self.client_optimizer.param_groups if self.client_optimizer is not None else [{}]
        if self.lr_source is not None:
            return [float(g["lr"]) for g in groups]
        return [float(self.optimizer.lr)] * len(groups)

    def get_global_grad_norm(self) -> float | None:
        """The norm of the last step's gradients (taken when clipping or fp16 need it)."""
        return self.last_grad_norm

    def was_step_applied(self) -> bool:
        return self._step_applied

    # -- the loop --------------------------------------------------------------------------------

    def backward(
        self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True
    ) -> torch.Tensor:
        """DeepSpeed's backward: returns the loss divided by gradient_accumulation_steps (unless
        `scale_wrt_gas` is false, when the loss is taken as scaled already)."""
        if retain_graph:
            raise NotImplementedError(
                "backward(retain_graph=True): the engine releases each unit's "
                "gradients as they become final, so a graph cannot be run twice"
            )
        super().backward(loss, scale_wrt_gas=scale_wrt_gas)
        gas = self.config.gradient_accumulation_steps
        return loss / gas if scale_wrt_gas and gas > 1 else loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        if lr_kwargs:
            raise NotImplementedError(
                "step(lr_kwargs=...): the engine steps the LR scheduler without arguments"
            )
        boundary = self.is_gradient_accumulation_boundary()
        skipped = self.skipped_steps
        super().step()
        self._step_applied = boundary and self.skipped_steps == skipped
        if self.lr_source is None and self.client_optimizer is not None:
            for group in self.client_optimizer.param_groups:  # the config's schedule moved the lr
                group["lr"] = self.optimizer.lr

    def zero_grad(self) -> None:
        """DeepSpeed's meaning: the parameters' `.grad` to None. It drops nothing the engine
        accumulated (those gradients live in the units and start over at each applied step); to
        drop them, use `infinity.Engine.zero_grad(engine)`."""
        for p in self.module.parameters():
            p.grad = None

    # -- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(
        self,
        save_dir: str | os.PathLike[str],
        tag: str | None = None,
        client_state: dict[str, Any] | None = None,
        save_latest: bool = True,
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's save: tag `global_step<N>` by default, `save_dir/latest` updated unless
        `save_latest` is false; every rank calls it. The client scheduler's state is saved with
        it. Frozen parameters are saved too (the format is by name, so they cost only space)."""
        if not save_dir:
            raise ValueError(f"save_dir must be a non-empty path, got {save_dir!r}")
        state = dict(client_state or {})
        state[STATE_KEY] = self._scheduler_state()
        super().save_checkpoint(
            save_dir,
            str(tag) if tag is not None else f"global_step{self.global_steps}",
            state,
            update_latest=save_latest,
        )
        return True

    def load_checkpoint(
        self,
        load_dir: str | os.PathLike[str],
        tag: str | None = None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn: Any = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """DeepSpeed's load: returns (path loaded, client_state), or (None, None) when
        `load_dir/latest` does not exist and no tag is given. `load_module_only` reads the
        values alone (optimizer state, counters and scheduler stay)."""
        if custom_load_fn is not None:
            raise NotImplementedError(
                "load_checkpoint(custom_load_fn=...): the engine reads its own format"
            )
        if tag is None:
            tag = latest_tag(load_dir)
            if tag is None:
                logger.warning(
                    "no checkpoint to load: %s has no 'latest' file (pass tag= to load one)",
                    Path(load_dir) / "latest",
                )
                return None, None
        kept = (self.counters.schedule_steps, self.optimizer.lr)
        state = super().load_checkpoint(
            load_dir, tag, load_optimizer_states=load_optimizer_states, values_only=load_module_only
        )
        saved = state.pop(STATE_KEY, None)
        if load_module_only:
            return str(Path(load_dir) / tag), state
        if not load_lr_scheduler_states:
            self.counters.schedule_steps, self.optimizer.lr = kept
        elif saved is not None:
            self._restore_scheduler(saved)
        return str(Path(load_dir) / tag), state

    def _scheduler_state(self) -> dict[str, Any]:
        groups = self.client_optimizer.param_groups if self.client_optimizer is not None else []
        scheduler = self.lr_scheduler if not isinstance(self.lr_scheduler, ConfigSchedule) else None
        return {
            "group_lrs": [float(g["lr"]) for g in groups],
            "lr_scheduler": scheduler.state_dict() if scheduler is not None else None,
        }

    def _restore_scheduler(self, saved: dict[str, Any]) -> None:
        """The client scheduler and its optimizer's learning rates as saved (torch keeps the
        latter in the optimizer's state dict, which the engine's checkpoint replaces)."""
        scheduler = self.lr_scheduler if not isinstance(self.lr_scheduler, ConfigSchedule) else None
        if scheduler is not None and saved.get("lr_scheduler") is not None:
            scheduler.load_state_dict(saved["lr_scheduler"])
        owner = (
            self.lr_source.optimizer
            if isinstance(self.lr_source, GroupsLR)
            else self.client_optimizer
        )
        lrs = saved.get("group_lrs") or []
        if owner is not None and len(lrs) == len(owner.param_groups):
            for group, lr in zip(owner.param_groups, lrs):
                group["lr"] = lr
        if self.lr_source is not None:
            self.optimizer.lr = self.lr_source.lr()

    # -- the model -------------------------------------------------------------------------------

    def save_16bit_model(
        self,
        save_dir: str | os.PathLike[str],
        save_filename: str = "pytorch_model.bin",
        exclude_frozen_parameters: bool = False,
    ) -> bool:
        """DeepSpeed's save of the model's weights (in the dtype they are stored: bf16/fp16, or
        fp32 when training in fp32) as one `torch.save` file `save_dir/save_filename`, for
        `module.load_state_dict(torch.load(...))`. Streamed: one unit's values in memory at a time.
        Every rank calls it (ZeRO-3 units are gathered); rank 0 writes."""
        model = self.module
        names: dict[int, list[str]] = {}
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(name)
        frozen = {s.name for u in self.units if not u.requires_grad for s in u.slots}
        specs, aliases = [], {}
        for unit in self.units:
            for slot in unit.slots:
                if exclude_frozen_parameters and slot.name in frozen:
                    continue
                specs.append((slot.name, slot.shape, unit.dtype))
                aliases[slot.name] = [n for n in names.get(id(slot.param), []) if n != slot.name]
        params = {n for ns in names.values() for n in ns}
        buffers = {
            n: b.detach().cpu()
            for n, b in model.state_dict(keep_vars=True).items()
            if n not in params
        }
        specs += [(n, b.shape, b.dtype) for n, b in buffers.items()]
        wanted = {s[0] for s in specs}
        values = self.parameter_views(lambda n: n in wanted)
        if self.ranks.rank != 0:
            for _ in values:  # take part in every gather
                pass
            return True
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        save_streamed(Path(save_dir) / save_filename, specs, aliases, _chain(values, buffers))
        logger.info("model saved to %s", Path(save_dir) / save_filename)
        return True

    def save_fp16_model(
        self, save_dir: str | os.PathLike[str], save_filename: str = "pytorch_model.bin"
    ) -> bool:
        return self.save_16bit_model(save_dir, save_filename)


def _chain(values: Any, buffers: dict[str, torch.Tensor]) -> Any:
    yield from values
    yield from buffers.items()
