"""A client's optimizer and LR scheduler under the engine (`initialize(optimizer=,
lr_scheduler=, model_parameters=)`), as DeepSpeed (with Accelerate's mapping of a torch
optimizer to DeepSpeedCPUAdam) takes them over.

- A torch `Adam` / `AdamW` becomes the engine's CPU Adam with its hyperparameters: its lr,
  betas and eps (one value for every group: the kernel steps every parameter at one learning
  rate), decoupled decay for AdamW (L2 for Adam), and each group's weight decay on that group's
  parameters (decay on weights, none on biases and norms, as the Trainer groups them). Any other
  optimizer, a group option the kernel does not have (amsgrad, maximize), groups that differ in
  lr, betas or eps, and a trained parameter in no group are refused, naming what differs.
- Without a client optimizer the config's `optimizer` section is used, over `model_parameters`
  (tensors or groups whose `weight_decay` may differ).
- The optimizer `initialize` returns (`EngineOptimizer`) holds those parameter groups (a client
  optimizer's are shared, so its scheduler's changes are seen): an LR scheduler built on it, or
  on the client's optimizer, moves the learning rate the engine reads at each update. The engine
  holds the state and steps it: its `step()` raises.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from infinity.engine import Engine

logger = logging.getLogger(__name__)

_SAME_IN_EVERY_GROUP = ("lr", "betas", "eps")
_NOT_IN_THE_KERNEL = {"amsgrad": False, "maximize": False}


@dataclass(frozen=True)
class ClientOptimizer:
    """What the engine's optimizer becomes for a client's optimizer or parameter groups."""

    section: (
        dict[str, Any] | None
    )  # the config's "optimizer" section to use (None: the config's own)
    groups: list[dict[str, Any]]  # the parameter groups stepped (a client optimizer's own dicts)
    decay_of: dict[
        str, float
    ]  # parameter name -> weight decay, where it differs from the section's
    owner: torch.optim.Optimizer | None  # the client's optimizer, whose groups these are


def take_over(
    model: torch.nn.Module,
    optimizer: Any,
    model_parameters: Iterable[Any] | None,
    section: dict[str, Any] | None = None,
) -> ClientOptimizer:
    """The client's optimizer (an instance, or a callable taking `model_parameters`), or without
    one the optimizer `section` of the config over `model_parameters`, checked as the module
    docstring says."""
    if (
        optimizer is not None
        and not isinstance(optimizer, torch.optim.Optimizer)
        and callable(optimizer)
    ):
        optimizer = optimizer(
            list(model.parameters() if model_parameters is None else model_parameters)
        )
    if optimizer is None:
        defaults = (section or {}).get("params", {})
        groups = _groups(model, model_parameters)
        for group in groups:
            for key, value in group.items():
                if key not in ("params", "weight_decay") and _plain(defaults.get(key)) != _plain(
                    value
                ):
                    raise ValueError(
                        f"model_parameters: a group sets {key}={value!r} where the config's "
                        "optimizer "
                        f"has {defaults.get(key)!r}; groups may differ in weight_decay only"
                    )
        default = float(defaults.get("weight_decay", 0.0))
        return ClientOptimizer(None, groups, _decay_of(model, groups, default), None)
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(
            f"client optimizer {type(optimizer).__module__}.{type(optimizer).__name__}: the engine "
            "steps Adam/AdamW on its CPU kernel; pass torch.optim.Adam or torch.optim.AdamW, or "
            "name the optimizer in the config's optimizer section"
        )
    if optimizer.state:
        raise ValueError(
            "the client optimizer has state (it has already stepped): the engine starts its "
            "own, so pass a fresh optimizer"
        )
    groups = [g for g in optimizer.param_groups if g["params"]]
    first = groups[0]
    for group in groups:
        for key, value in _NOT_IN_THE_KERNEL.items():
            if group.get(key, value) != value:
                raise ValueError(
                    f"client optimizer: {key}={group[key]!r} is not in the engine's CPU Adam"
                )
        for key in _SAME_IN_EVERY_GROUP:
            if _plain(group[key]) != _plain(first[key]):
                raise ValueError(
                    f"client optimizer: parameter groups differ in {key} ({_plain(first[key])!r} "
                    f"vs {_plain(group[key])!r}); the engine's CPU Adam takes one {key} for "
                    "every parameter (groups may differ in weight_decay)"
                )
    decoupled = {
        bool(g.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW)))
        for g in groups
    }
    if len(decoupled) > 1:
        raise ValueError("client optimizer: groups differ in decoupled_weight_decay")
    adamw = decoupled.pop()
    decay = _main_decay(groups)
    section = {
        "type": "AdamW" if adamw else "Adam",
        "params": {
            "lr": _plain(first["lr"]),
            "betas": list(_plain(first["betas"])),
            "eps": _plain(first["eps"]),
            "weight_decay": decay,
            "adam_w_mode": adamw,
        },
    }
    _check_covered(model, groups)
    return ClientOptimizer(section, groups, _decay_of(model, groups, decay), optimizer)


def _plain(value: Any) -> Any:
    """A hyperparameter as a Python number (torch allows tensors for lr and betas)."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    return value


def _groups(model: torch.nn.Module, model_parameters: Iterable[Any] | None) -> list[dict[str, Any]]:
    """`model_parameters` (tensors, or dicts of torch's param-group form) as groups."""
    items = list(model.parameters() if model_parameters is None else model_parameters)
    if items and all(isinstance(item, dict) for item in items):
        groups = [dict(item, params=list(item["params"])) for item in items]
    elif all(isinstance(item, torch.Tensor) for item in items):
        groups = [{"params": items}]
    else:
        raise TypeError("model_parameters must be tensors or parameter-group dicts, not a mix")
    groups = [g for g in groups if g["params"]]
    _check_covered(model, groups)
    return groups


def _check_covered(model: torch.nn.Module, groups: list[dict[str, Any]]) -> None:
    """Every trained parameter of the model is in a group (the engine steps every one of them;
    DeepSpeed would silently leave one out)."""
    grouped = {id(p) for g in groups for p in g["params"]}
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in grouped:
            raise ValueError(
                f"parameter {name!r} requires grad but is in no optimizer group: add it, or set "
                "its requires_grad to False"
            )


def _main_decay(groups: list[dict[str, Any]]) -> float:
    """The weight decay of the most elements (the others get theirs by range)."""
    size: dict[float, int] = {}
    for group in groups:
        decay = float(group.get("weight_decay", 0.0))
        size[decay] = size.get(decay, 0) + sum(p.numel() for p in group["params"])
    return max(size, key=size.get)


def _decay_of(
    model: torch.nn.Module, groups: list[dict[str, Any]], default: float
) -> dict[str, float]:
    """Name (every name of a tied parameter) -> its group's weight decay, where not `default`."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    decay_of = {}
    for group in groups:
        decay = float(group.get("weight_decay", default))
        if decay != default:
            for p in group["params"]:
                decay_of.update((name, decay) for name in names.get(id(p), []))
    return decay_of


class EngineOptimizer(torch.optim.Optimizer):
    """The optimizer `initialize` returns: the parameter groups the engine's CPU Adam steps,
    for LR schedulers and for reading; the engine holds the state and steps it."""

    def __init__(self, engine: Engine, client: ClientOptimizer, hyper: dict[str, Any]) -> None:
        super().__init__(
            [{**hyper, **g, "params": list(g["params"])} for g in client.groups], hyper
        )
        if client.owner is not None:
            self.param_groups = (
                client.owner.param_groups
            )  # shared: the client's scheduler moves them
        self.engine = engine

    def step(self, closure: Any = None) -> None:
        raise RuntimeError(
            "engine.step() updates the parameters (the engine's CPU Adam holds the state): "
            "call it after each backward instead of optimizer.step()"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine starts its gradients over at each applied step."""

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(
            "the optimizer's state lives in the engine's store: save it with "
            "engine.save_checkpoint and restore it with engine.load_checkpoint"
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.state_dict()


class GroupsLR:
    """The engine's learning rate from torch parameter groups (`LRSource`): the lr they hold
    when an update is built (one value: they must agree), moved by `scheduler` (if any) after
    each applied update."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any = None) -> None:
        self.optimizer, self.scheduler = optimizer, scheduler

    def lr(self) -> float:
        lrs = [float(_plain(g["lr"])) for g in self.optimizer.param_groups if g["params"]]
        if len(set(lrs)) > 1:
            raise ValueError(
                f"the parameter groups' learning rates differ ({lrs}): the engine's CPU Adam "
                "takes one learning rate per step"
            )
        return lrs[0]

    def advance(self) -> None:
        if self.scheduler is not None:
            self.optimizer._opt_called = True  # the engine's update is this optimizer's step
            self.scheduler.step()


class ConfigSchedule:
    """The config's scheduler, which the engine itself steps at each applied update (what
    `initialize` returns for it): the learning rate it gives, read-only."""

    def __init__(self, engine: Engine, groups: int) -> None:
        self.engine, self.groups = engine, groups

    def get_last_lr(self) -> list[float]:
        return [float(self.engine.optimizer.lr)] * self.groups

    def get_lr(self) -> list[float]:
        return self.get_last_lr()

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "the engine steps the config's scheduler at each applied update (engine.step())"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.engine.counters.schedule_steps - 1}
