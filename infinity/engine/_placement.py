"""Where a model's parameters go, decided before anything moves (fetch units, the memory plan,
the store), and the hand-over of a model whose parameters were already placed.

[Note: placed models] `infinity.models.load` streams a checkpoint straight into a store laid
out exactly as `initialize` would lay it out, and hands (layout, store) over in the model's
public attribute `infinity_placed` (a `Placed`; the documented contract between the two, see
both docstrings). The engine then adopts them instead of placing the parameters again and
removes the attribute: no copy, no moment where the model exists whole in memory. The config
given to `initialize` must lay the model out the same way (precision, persistence threshold,
tiers); the store's budgets stay those of the load.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass

import torch

from infinity.config import Config
from infinity.engine._plan import MemoryPlan, fit_nvme_budget, plan_memory
from infinity.engine._precision import Precision, choose_precision, cpu_has_bf16_units
from infinity.errors import ConfigError
from infinity.optim import StateFormat
from infinity.store import TensorStore, Tier
from infinity.zero import FetchUnit, plan_units

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Layout:
    """How a model's parameters are cut and where they live (nothing moved yet)."""

    precision: Precision
    device: torch.device  # where modules compute
    persistence_numel: int  # parameters this small or smaller go to resident units
    resident_modules: bool  # every module's unit resident too (see `keeps_units_resident`)
    units: list[FetchUnit]
    uses: dict[torch.nn.Module, list[FetchUnit]]  # module -> non-resident units it uses
    plan: MemoryPlan


@dataclass(frozen=True, slots=True)
class Placed:
    """A model's parameters already in `store` per `layout`: what `infinity.models.load` leaves
    in `model.infinity_placed` for `initialize` to adopt (see [Note: placed models])."""

    layout: Layout
    store: TensorStore


def choose_model_precision(config: Config) -> tuple[Precision, torch.device]:
    """The precision plan and compute device for `config` on this machine."""
    accelerator = torch.cuda.is_available()
    device = (torch.device("cuda", torch.cuda.current_device()) if accelerator
              else torch.device("cpu"))
    precision = choose_precision(
        fp16=config.fp16.enabled, bf16=config.bf16.enabled,
        compute_dtype=config.infinity.compute_dtype,
        accelerator=accelerator, bf16_units=cpu_has_bf16_units())
    return precision, device


def lay_out(model: torch.nn.Module, config: Config, precision: Precision, device: torch.device, *,
            meta_ok: bool = False) -> Layout:
    """Cut `model` (already in the compute dtype and on `device`, or on the meta device with
    `meta_ok`) into units and plan the store's budgets; raises BudgetError."""
    zero = config.zero_optimization
    # Below stage 3 nothing is partitioned: every parameter stays resident.
    persistence = zero.stage3_param_persistence_threshold if zero.stage == 3 else 1 << 62
    resident = keeps_units_resident(config, device)
    units, uses = plan_units(model, persistence_numel=persistence, storage_dtype=precision.storage,
                             meta_ok=meta_ok, resident_modules=resident)
    plan = _plan(units, config, device)
    logger.info("engine: stage %d, params at home on %s, optimizer state %s; store budgets %s",
                zero.stage, plan.param_home.label, plan.state_tier.label,
                {t.label: n for t, n in plan.budgets.items()})
    return Layout(precision, device, persistence, resident, units, uses, plan)


def optimizer_overlaps(config: Config, device: torch.device) -> bool:
    """Whether units are stepped during backward: see [Note: optimizer overlapped with
    backward] (infinity/engine/_overlap.py) and `infinity.overlap_optimizer`."""
    asked = config.infinity.overlap_optimizer
    if asked != "auto":
        return asked
    zero = config.zero_optimization
    uses_nvme = ((zero.stage == 3 and zero.offload_param.device == "nvme")
                 or zero.offload_optimizer.device == "nvme")
    return device.type != "cpu" or uses_nvme


def keeps_units_resident(config: Config, device: torch.device) -> bool:
    """Whether every module's unit stays bound from the first forward of a step to the step:
    ZeRO-3 on one process with offload_param "none" and the optimizer not overlapped. The
    values then never leave the tier the modules compute from, so releasing a unit frees
    nothing, and fetching it again for each use cost hook time (a 294M GPT: ~30 ms a forward,
    ~4%). The units keep their per-module cut: each one's gradient is still taken (and checked)
    as soon as it is final, while it is in cache."""
    zero = config.zero_optimization
    return zero.stage == 3 and config.world_size == 1 and zero.offload_param.device == "none" \
        and not optimizer_overlaps(config, device)


def state_format(config: Config) -> StateFormat:
    """How the optimizer keeps its state: `infinity.optimizer_state`."""
    chosen = config.infinity.optimizer_state
    return StateFormat(moments=chosen.moments, master=chosen.master)


def _plan(units: list[FetchUnit], config: Config, device: torch.device) -> MemoryPlan:
    zero = config.zero_optimization
    return plan_memory(
        units, offload_param=zero.offload_param.device if zero.stage == 3 else "none",
        offload_optimizer=zero.offload_optimizer.device, accelerator=device.type != "cpu",
        prefetch_numel=zero.stage3_prefetch_bucket_size if config.infinity.trace_prefetch else 0,
        tile_numel=zero.sub_group_size, host_memory_budget=config.infinity.host_memory_budget,
        world=config.world_size, stage=zero.stage, state_format=state_format(config),
        speculates=optimizer_overlaps(config, device))


def open_store(layout: Layout, config: Config, *, rank: int = 0) -> TensorStore:
    """The store with the layout's budgets (its swap file under the config's nvme_path, one
    per rank and process)."""
    zero = config.zero_optimization
    nvme_path = zero.offload_param.nvme_path if layout.plan.param_home == Tier.NVME else None
    nvme_path = nvme_path or zero.offload_optimizer.nvme_path
    aio_options = {**config.aio.handle_options(), "backend": config.infinity.aio_backend}
    budgets = dict(layout.plan.budgets)
    if Tier.NVME in budgets and nvme_path is not None and os.path.isdir(nvme_path):
        # ranks share one node's disk (this engine's setting), each opening its own swap file
        free = shutil.disk_usage(nvme_path).free // config.world_size
        keep_free = config.infinity.nvme_keep_free // config.world_size
        fitted = fit_nvme_budget(budgets[Tier.NVME], layout.plan.nvme_kept_nbytes, free,
                                 keep_free)
        if fitted != budgets[Tier.NVME]:
            logger.warning("engine: the disk under nvme_path %s has %d bytes free, not the %d a "
                           "speculated step's kept state needs beside the rest and the %d of "
                           "infinity.nvme_keep_free; units without room are stepped after "
                           "validation", nvme_path, free, budgets[Tier.NVME], keep_free)
            budgets[Tier.NVME] = fitted
    return TensorStore(budgets, nvme_path=nvme_path, device=layout.device,
                       aio_options=aio_options, rank=rank)


def take_placed(model: torch.nn.Module, config: Config, precision: Precision,
                device: torch.device, *, sharded_params: bool = False) -> Placed | None:
    """`model.infinity_placed` (removed from it: one engine owns the store), after
    checking that `config` lays the model out the same way; None for an ordinary model.

    Raises ConfigError naming what differs, or when the engine keeps only a shard of each
    unit (`sharded_params`: stage 3 on several ranks), which a loaded store does not hold;
    the model keeps its placement then.
    """
    placed: Placed | None = getattr(model, "infinity_placed", None)
    if placed is None:
        return None
    if sharded_params:
        raise ConfigError(f"zero_optimization.stage 3 with {config.world_size} ranks cannot adopt "
                          "a model from infinity.models.load (its store holds whole units, stage 3 "
                          "keeps one shard per rank): use stage 0-2, or one rank")
    layout = placed.layout
    zero = config.zero_optimization
    persistence = zero.stage3_param_persistence_threshold if zero.stage == 3 else 1 << 62
    plan = _plan(layout.units, config, device)
    found = {"precision": (precision, layout.precision), "device": (device, layout.device),
             "persistence threshold": (persistence, layout.persistence_numel),
             "resident modules": (keeps_units_resident(config, device), layout.resident_modules),
             "parameter home": (plan.param_home, layout.plan.param_home),
             "optimizer state tier": (plan.state_tier, layout.plan.state_tier),
             "gradient home": (plan.grads_tier, layout.plan.grads_tier)}
    differ = [f"{what} {now} (loaded with {then})"
              for what, (now, then) in found.items() if now != then]
    if differ:
        raise ConfigError("this model was loaded into the store under another config; initialize "
                          "it with the config given to infinity.models.load. Differs: "
                          + "; ".join(differ))
    del model.infinity_placed
    return placed
