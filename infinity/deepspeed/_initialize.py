"""`initialize`, `add_config_arguments` and `init_distributed` with DeepSpeed's signatures and
meanings, over Infinity's engine."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from infinity.config import AdamParams, Config, OptimizerConfig
from infinity.deepspeed._engine import DeepSpeedEngine
from infinity.deepspeed._optimizer import (
    ClientOptimizer,
    ConfigSchedule,
    EngineOptimizer,
    GroupsLR,
    take_over,
)
from infinity.engine import attach_to_model, engine_config, set_weight_decay
from infinity.errors import ConfigError
from infinity.zero.ranks import end_group_at_exit

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29500  # DeepSpeed's TORCH_DISTRIBUTED_DEFAULT_PORT

# DeepSpeed features whose config sections load but do nothing here: said once, at WARNING.
_NOT_DONE = {
    "pipeline": "no pipeline engine (the model trains as one module)",
    "expert_parallel": "no expert parallelism (MoE layers train as ordinary modules)",
    "tensor_parallel": "no tensor parallelism",
    "comet": "no monitor writes events (the Trainer's report_to does)",
}
_MONITORS = ("tensorboard", "csv_monitor", "wandb")


def initialize(
    args: Any = None,
    model: torch.nn.Module | None = None,
    optimizer: Any = None,
    model_parameters: Iterable[Any] | None = None,
    training_data: Any = None,
    lr_scheduler: Any = None,
    distributed_port: int = DEFAULT_PORT,
    mpu: Any = None,
    dist_init_required: bool | None = None,
    collate_fn: Callable[..., Any] | None = None,
    config: dict[str, Any] | str | None = None,
    mesh_param: Any = None,
    config_params: dict[str, Any] | str | None = None,
) -> tuple[DeepSpeedEngine, EngineOptimizer, torch.utils.data.DataLoader | None, Any]:
    """DeepSpeed's `initialize` -> (engine, optimizer, training_dataloader, lr_scheduler).

    The config comes from `config`, else `config_params`, else `args.deepspeed_config` (two of
    them is an error, as in DeepSpeed). `optimizer`: a torch Adam/AdamW (or a callable making one
    from `model_parameters`) taken over by the engine's CPU Adam, its groups' weight decays kept
    (see infinity/deepspeed/_optimizer.py); without one, the config's optimizer over
    `model_parameters`. `lr_scheduler`: a scheduler on that optimizer, or a callable taking the
    returned optimizer; the engine steps it at each applied update and every update uses its
    learning rate; returned as given. Without one, the config's scheduler (a read-only view is
    returned), else None. `training_data`: a map-style dataset, returned as a DataLoader of
    micro-batches over a DistributedSampler (seed 0: the same order in every process, as
    DeepSpeed's loader). `mpu` and `mesh_param` are refused (no model parallelism);
    `distributed_port` is used by `dist_init_required=True` only.
    """
    if model is None:
        raise ValueError("initialize() needs model=")
    if mpu is not None:
        raise NotImplementedError(
            "initialize(mpu=...): Infinity has no model parallelism (tensor or pipeline); "
            "its ranks are data-parallel only"
        )
    if mesh_param is not None:
        raise NotImplementedError(
            "initialize(mesh_param=...): Infinity's ranks are data-parallel only"
        )
    if dist_init_required:
        init_distributed(distributed_port=distributed_port)
    source = _config_source(args, config, config_params)
    client = take_over(model, optimizer, model_parameters) if optimizer is not None else None
    scheduler_given = lr_scheduler is not None
    if scheduler_given and not callable(lr_scheduler) and client is None:
        raise ValueError(
            "an LR scheduler instance needs the optimizer it was built on (optimizer=); or pass a "
            "callable that takes the optimizer initialize returns"
        )
    loaded = _with_client(engine_config(model, source), client, scheduler_given)
    if client is None:  # the config's optimizer over model_parameters, with their weight decays
        client = take_over(model, None, model_parameters, _section(loaded))
    _warn_not_done(loaded)
    engine = DeepSpeedEngine(model, loaded)
    try:
        attach_to_model(engine)
        set_weight_decay(engine, client.decay_of)
        engine.client_optimizer = EngineOptimizer(engine, client, _section(loaded)["params"])
        _set_scheduler(engine, client, lr_scheduler, loaded)
        if training_data is not None:
            engine.training_dataloader = _dataloader(engine, training_data, collate_fn)
    except BaseException:
        engine.close()
        raise
    return engine, engine.client_optimizer, engine.training_dataloader, engine.lr_scheduler


def _config_source(args: Any, config: Any, config_params: Any) -> Any:
    if config is None:
        config = config_params
    for name in ("deepspeed_config", "deepscale_config"):
        from_args = getattr(args, name, None)
        if from_args is not None:
            if config is not None:
                raise ValueError(
                    f"two DeepSpeed configs: args.{name} and initialize(config=...); give one"
                )
            config = from_args
    if config is None:
        raise ValueError(
            "no DeepSpeed config: pass config= (a dict or a JSON path), or --deepspeed_config "
            "(deepspeed.add_config_arguments(parser))"
        )
    return config


def _section(config: Config) -> dict[str, Any]:
    """The optimizer the engine runs, as a config section (the engine's default without one)."""
    opt = config.optimizer or OptimizerConfig(type="AdamW", params=AdamParams())
    p = opt.params
    return {
        "type": opt.type,
        "params": {
            "lr": p.lr,
            "betas": tuple(p.betas),
            "eps": p.eps,
            "weight_decay": p.weight_decay,
            "adam_w_mode": opt.decoupled_weight_decay,
        },
    }


def _with_client(config: Config, client: ClientOptimizer | None, scheduler_given: bool) -> Config:
    """The config with the client's optimizer in place of its own, and without its scheduler
    when the client gives one (DeepSpeed uses the client's then)."""
    changes: dict[str, Any] = {}
    if client is not None:
        if config.optimizer is not None:
            logger.info("initialize: the client optimizer replaces the config's optimizer section")
        params = client.section["params"]
        changes["optimizer"] = OptimizerConfig(
            type=client.section["type"],
            params=AdamParams(
                lr=params["lr"],
                betas=tuple(params["betas"]),
                eps=params["eps"],
                weight_decay=params["weight_decay"],
                adam_w_mode=params["adam_w_mode"],
            ),
        )
    if scheduler_given and config.scheduler is not None:
        logger.info("initialize: the client LR scheduler replaces the config's scheduler section")
        changes["scheduler"] = None
    return dataclasses.replace(config, **changes) if changes else config


def _set_scheduler(
    engine: DeepSpeedEngine, client: ClientOptimizer, lr_scheduler: Any, config: Config
) -> None:
    owner = client.owner or engine.client_optimizer
    if lr_scheduler is None:
        if config.scheduler is not None:
            engine.lr_scheduler = ConfigSchedule(engine, len(engine.client_optimizer.param_groups))
        else:  # the groups' own lr, which the caller may change between steps
            engine.lr_source = GroupsLR(owner)
    else:
        scheduler = lr_scheduler(owner) if callable(lr_scheduler) else lr_scheduler
        if getattr(scheduler, "optimizer", None) not in (owner, engine.client_optimizer):
            raise ValueError(
                "the LR scheduler was not built on the optimizer given to initialize (its "
                "optimizer= , or the one initialize returns)"
            )
        engine.lr_scheduler = scheduler
        engine.lr_source = GroupsLR(scheduler.optimizer, scheduler)
    if engine.lr_source is not None:
        engine.optimizer.lr = engine.lr_source.lr()


def _warn_not_done(config: Config) -> None:
    sections = {note.split(" ", 1)[0] for note in config.not_honoured}
    said = [f"{name} ({why})" for name, why in _NOT_DONE.items() if name in sections]
    said += [
        f"{name} ({_NOT_DONE['comet']})" for name in _MONITORS if getattr(config, name).enabled
    ]
    if said:
        logger.warning("infinity.deepspeed: accepted, not done: %s (docs/hf.md)", "; ".join(said))


def _dataloader(
    engine: DeepSpeedEngine, dataset: Any, collate_fn: Callable[..., Any] | None
) -> torch.utils.data.DataLoader:
    """DeepSpeed's training loader: micro-batches of this rank's share, DistributedSampler with
    its default seed (0), so every process started alike sees the same order."""
    if isinstance(dataset, torch.utils.data.IterableDataset) or not (
        hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")
    ):
        raise ValueError(
            "training_data must be a map-style torch Dataset (indexable, with a length)"
        )
    micro = engine.config.train_micro_batch_size_per_gpu
    if micro is None:
        raise ConfigError(
            "training_data needs train_micro_batch_size_per_gpu (or train_batch_size) in the config"
        )
    sampler = torch.utils.data.DistributedSampler(
        dataset, num_replicas=engine.ranks.world, rank=engine.ranks.rank
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=micro,
        sampler=sampler,
        collate_fn=collate_fn,
        pin_memory=torch.cuda.is_available(),
    )


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line flags: --deepspeed, --deepspeed_config (and the deprecated
    --deepscale, --deepscale_config)."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (run by Infinity)")
    group.add_argument(
        "--deepspeed",
        default=False,
        action="store_true",
        help="Enable DeepSpeed (a flag for the script; Infinity runs either way)",
    )
    group.add_argument(
        "--deepspeed_config", default=None, type=str, help="DeepSpeed JSON configuration file."
    )
    group.add_argument(
        "--deepscale", default=False, action="store_true", help="Deprecated: --deepspeed"
    )
    group.add_argument(
        "--deepscale_config", default=None, type=str, help="Deprecated: --deepspeed_config"
    )
    return parser


def init_distributed(
    dist_backend: str | None = None,
    auto_mpi_discovery: bool = True,
    distributed_port: int = DEFAULT_PORT,
    verbose: bool = True,
    timeout: datetime.timedelta = datetime.timedelta(minutes=30),
    init_method: str | None = None,
    dist_init_required: bool | None = None,
    config: Any = None,
    rank: int = -1,
    world_size: int = -1,
) -> None:
    """Start torch.distributed as DeepSpeed does: from torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), else `rank`/`world_size` given here, else one process; gloo on
    CPUs, NCCL with CUDA. Nothing when a group exists (or `dist_init_required` is False)."""
    if dist_init_required is False or (dist.is_available() and dist.is_initialized()):
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if rank < 0 and "RANK" in os.environ:
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if rank < 0 and init_method is None:  # one process: a group of one over an in-memory store
        where: dict[str, Any] = {"store": dist.HashStore(), "rank": 0, "world_size": 1}
        if verbose:
            logger.info("init_distributed: one process over %s", backend)
    else:
        if init_method is None:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(distributed_port))
            init_method = "env://"
        where = {"init_method": init_method, "rank": rank, "world_size": world_size}
        if verbose:
            logger.info(
                "init_distributed: rank %d of %d over %s (%s)", rank, world_size, backend,
                init_method
            )
    dist.init_process_group(backend, timeout=timeout, **where)
    end_group_at_exit()
