"""`infinity.hf.Trainer`: transformers' Trainer, training through Infinity's engine (parameters,
gradients and optimizer state in the tiered store) as `TrainingArguments(deepspeed=...)` trains
through DeepSpeed's.

The Trainer's own loop runs unchanged; what DeepSpeed's integration does at each point, the
engine does here:

- `train()` fills the config's "auto" values from the arguments (infinity/hf/_config.py) and
  starts the engine with `infinity.deepspeed.initialize`: the Trainer's AdamW (decay and
  no-decay groups) and its `lr_scheduler_type` with warmup when the config names no optimizer
  or scheduler, else the config's (as transformers picks them).
- Each micro-batch's backward is the engine's (the loss is already scaled for accumulation, as
  DeepSpeed's `scale_wrt_gas=False`); at an accumulation boundary the engine's step runs where
  the Trainer clips (its norm is the logged `grad_norm`), and the scheduler moves with the
  engine's applied steps. The logged `learning_rate` is the one the update used, as the
  Trainer logs it without DeepSpeed.
- Checkpoints (`save_steps`) hold the engine's checkpoint (`global_step<N>`, crash-safe) beside
  the Trainer's state and RNG files; `resume_from_checkpoint` restores both.
- `save_model()` streams the weights from the store as safetensors shards (`save_pretrained`).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import transformers
from transformers.optimization import get_scheduler

import infinity.deepspeed as deepspeed
from infinity.hf._config import fill_from_training_args, read_config

logger = logging.getLogger(__name__)


class Trainer(transformers.Trainer):
    """transformers.Trainer with `config=` (a DeepSpeed JSON path or dict) whose model trains
    through Infinity's engine; every other argument is the Trainer's. See docs/hf.md.

    `self.engine` is the engine once `train()` started it (None before).
    """

    def __init__(
        self,
        *args: Any,
        config: dict[str, Any] | str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        if config is None:
            raise TypeError("infinity.hf.Trainer needs config= (a DeepSpeed JSON path or dict)")
        self.infinity_config = read_config(config)
        self.engine: deepspeed.DeepSpeedEngine | None = None
        self._step_pending = False  # the boundary's backward ran, its engine step not yet
        self._step_lr: float | None = None  # the learning rate of the last applied update
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(
                "infinity.hf.Trainer trains through Infinity's engine: drop TrainingArguments' "
                "deepspeed/fsdp settings (the DeepSpeed config goes to config=)"
            )
        self.accelerator.backward = self._engine_backward

    # -- starting the engine ---------------------------------------------------------------------

    def _prepare_for_training(
        self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: str | None
    ) -> tuple[Any, Any]:
        if self.engine is not None:
            raise RuntimeError(
                "train() a second time on one infinity.hf.Trainer: the engine holds the model; "
                "make a new Trainer (resume_from_checkpoint continues a run)"
            )
        config = fill_from_training_args(self.infinity_config, self.args, self.model, max_steps)
        # Yours (Trainer(optimizers=...)), else the config's, else the Trainer's own, as
        # transformers picks them.
        optimizer = (
            self.create_optimizer()
            if self.optimizer is not None or "optimizer" not in config
            else None
        )
        scheduler = self.lr_scheduler
        if scheduler is None and "scheduler" not in config:

            def scheduler(opt: torch.optim.Optimizer) -> Any:
                return get_scheduler(
                    self.args.lr_scheduler_type,
                    optimizer=opt,
                    num_warmup_steps=self.args.get_warmup_steps(max_steps),
                    num_training_steps=max_steps,
                    scheduler_specific_kwargs=self.args.lr_scheduler_kwargs,
                )

        trained = [p for p in self.model.parameters() if p.requires_grad]
        engine, engine_optimizer, _, engine_scheduler = deepspeed.initialize(
            model=self.model,
            optimizer=optimizer,
            model_parameters=trained,
            lr_scheduler=scheduler,
            config=config,
        )
        self.engine = self.model_wrapped = engine
        self.optimizer = _StepsWithTheEngine(self, engine_optimizer)
        self.lr_scheduler = _MovesWithTheEngine(self, engine_scheduler)
        if resume_from_checkpoint is not None:
            path, _ = engine.load_checkpoint(resume_from_checkpoint)
            if path is None:
                raise ValueError(
                    f"{resume_from_checkpoint} holds no engine checkpoint (no 'latest' file)"
                )
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return engine, train_dataloader

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> Any:
        if self.engine is None and getattr(self.model, "infinity_placed", None) is not None:
            raise RuntimeError(
                "evaluate()/predict() before train() on a model loaded into the store "
                "(infinity.hf.from_pretrained): its values reach the model through the "
                "engine, which train() starts"
            )
        return super().evaluation_loop(*args, **kwargs)

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: torch.nn.Module | None = None
    ) -> None:
        """Nothing here: the engine loads its checkpoint when `train()` starts it."""

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        logger.info("loading the best model from %s", best)
        self.engine.load_checkpoint(best)

    # -- the step --------------------------------------------------------------------------------

    def _engine_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """The Trainer's `accelerator.backward`: the engine's backward of a loss already scaled
        for accumulation; between boundaries the engine counts the micro-batch."""
        if self.engine is None:
            raise RuntimeError("infinity.hf.Trainer: backward before train() started the engine")
        self.engine.set_gradient_accumulation_boundary(self.accelerator.sync_gradients)
        self.engine.backward(loss, scale_wrt_gas=False)
        if self.accelerator.sync_gradients:
            self._step_pending = True
        else:
            self.engine.step()

    def _take_engine_step(self) -> None:
        """The boundary's step (clip, update, scheduler), once."""
        if self._step_pending:
            self._step_pending = False
            self._step_lr = self.engine.get_lr()[0]
            self.engine.step()

    def _clip_grad_norm(self, model: torch.nn.Module) -> float | None:
        self._take_engine_step()
        return self.engine.get_global_grad_norm()

    def _get_grad_norm(
        self, model: torch.nn.Module, grad_norm: float | None = None
    ) -> float | None:
        self._take_engine_step()
        return grad_norm if grad_norm is not None else self.engine.get_global_grad_norm()

    def _get_learning_rate(self) -> float:
        if self._step_lr is not None:
            return self._step_lr
        return super()._get_learning_rate()

    # -- saving ----------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The weights streamed from the store (`save_pretrained`: safetensors shards, config,
        tokenizer, training arguments). In checkpoints only where DeepSpeed writes them there
        too: below stage 3, or with stage3_gather_16bit_weights_on_model_save (the engine's
        checkpoint holds the values either way). Every rank calls it."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        zero = self.engine.config.zero_optimization
        if (
            _internal_call
            and zero.stage == 3
            and not zero.stage3_gather_16bit_weights_on_model_save
            and not self.args.save_only_model
        ):
            return None
        if not self.args.should_save:  # the other ranks take part in the ZeRO-3 gathers
            self.model.save_pretrained(output_dir or self.args.output_dir, is_main_process=False)
            return None
        return super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's checkpoint (`output_dir/global_step<N>`, with the scheduler's state), as
        DeepSpeed's integration saves it; every rank calls it."""
        self.engine.save_checkpoint(output_dir)


class _StepsWithTheEngine(torch.optim.Optimizer):
    """The Trainer's `optimizer`: the engine's parameter groups; `step()` is the engine's step
    (taken once per boundary, where the Trainer clips), `zero_grad()` the engine's business."""

    def __init__(self, trainer: Trainer, optimizer: torch.optim.Optimizer) -> None:
        self.trainer, self.optimizer = trainer, optimizer
        self.defaults, self.state = optimizer.defaults, optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def step(self, closure: Any = None) -> None:
        self.trainer._take_engine_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine starts its gradients over at each applied step."""

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


class _MovesWithTheEngine:
    """The Trainer's `lr_scheduler`: the engine steps the real one at each applied update, so
    `step()` does nothing here; the learning rates are the real scheduler's."""

    def __init__(self, trainer: Trainer, scheduler: Any) -> None:
        self.trainer, self.scheduler = trainer, scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        if self.scheduler is not None:
            return self.scheduler.get_last_lr()
        return self.trainer.engine.get_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict() if self.scheduler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict)
