"""Synthetic DeepSpeed ZeRO checkpoints (stages 1, 2, 3) built from known weights, pickling what
DeepSpeed 0.19.8 writes: its file names and dictionary keys (engine.py `_save_checkpoint`,
`_common_checkpoint_state`, `_save_zero_checkpoint`; stage_1_and_2.py and stage3.py
`state_dict`), its pickled classes under their real module paths (`LossScaler`, or
`DynamicLossScaler` with its torch dtype for fp16; `ZeroStageEnum`; `fragment_address`), stage
3's fp32 flat partitions as tensors that require grad and carry a `ds_id` attribute (so they
pickle through `torch._tensor._rebuild_from_type_v2`, as do the NVMe placeholders and their
moments), stage 1/2's unpadded partitions as views into padded storage, DeepSpeed's optimizers'
integer Adam `step`, and partition padding - for tests of readers that must return exactly
those weights without DeepSpeed installed.

Padding slots hold JUNK instead of DeepSpeed's zeros, so a reader that does not trim them fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
import sys
import types
from collections import OrderedDict
from pathlib import Path

import torch

JUNK = 7.25
DS_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _module(name: str) -> types.ModuleType:
    parts = name.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    return sys.modules[name]


@contextlib.contextmanager
def _deepspeed_classes():
    """DeepSpeed's pickled classes under their real module paths while the files are written;
    the fake `deepspeed` modules are gone afterwards, so readers run without it."""
    loss_scaler, config, fragment = (_module(n) for n in (
        "deepspeed.runtime.fp16.loss_scaler", "deepspeed.runtime.zero.config",
        "deepspeed.utils.tensor_fragment"))

    class LossScaler:  # DeepSpeed's static scaler: bf16 and fp32 runs, fp16 without dynamic
        def __init__(self, scale=1.0):
            self.cur_scale, self.dynamic = scale, False

    class DynamicLossScaler(LossScaler):  # fp16 with dynamic loss scaling
        def __init__(self):
            super().__init__(2.0 ** 16)
            self.cur_iter, self.last_overflow_iter, self.scale_factor = 7, -1, 2.0
            self.scale_window, self.min_scale, self.delayed_shift = 1000, 1.0, 2
            self.cur_hysteresis, self.consecutive_hysteresis = 2, False
            self.raise_error_at_min_scale, self.dynamic, self.dtype = True, True, torch.float16

    class ZeroStageEnum(int, enum.Enum):
        disabled, optimizer_states, gradients, weights = 0, 1, 2, 3

    @dataclasses.dataclass
    class fragment_address:  # noqa: N801 (DeepSpeed's name)
        numel: int
        start: int

    for mod, cls in ((loss_scaler, LossScaler), (loss_scaler, DynamicLossScaler),
                     (config, ZeroStageEnum), (fragment, fragment_address)):
        cls.__module__, cls.__qualname__ = mod.__name__, cls.__name__
        setattr(mod, cls.__name__, cls)
    try:
        yield types.SimpleNamespace(static=LossScaler, dynamic=DynamicLossScaler,
                                    stage=ZeroStageEnum, fragment_address=fragment_address)
    finally:
        for name in [n for n in sys.modules if n == "deepspeed" or n.startswith("deepspeed.")]:
            del sys.modules[name]


def _flat_partition(tensor: torch.Tensor, ds_id: str) -> torch.Tensor:
    """A stage 3 fp32 flat partition as DeepSpeed keeps it: a leaf requiring grad, with the
    ds_ids of its sub-group's first and last parameter as a Python attribute."""
    tensor = tensor.detach().clone().requires_grad_(True)
    tensor.ds_id = ds_id
    return tensor


def _padded(flat: torch.Tensor, numel: int) -> torch.Tensor:
    return torch.cat([flat, torch.full((numel - flat.numel(),), JUNK, dtype=flat.dtype)])


def moments(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The Adam moments the synthetic checkpoints hold for a weight."""
    return {"exp_avg": weight * 0.125, "exp_avg_sq": weight.abs() * 0.5 + 1}


def write(root: Path, params: dict[str, torch.Tensor], *, stage: int, world_size: int = 2,
          precision: str = "bf16", buffers: dict | None = None, frozen: dict | None = None,
          shared: dict[str, str] | None = None, tag: str = "global_step7",
          sub_group_numel: int = 1000, groups: list[list[str]] | None = None,
          nvme_offload: bool = False) -> dict[str, torch.Tensor]:
    """Write a checkpoint of `params` (trainable, fp32) under root/tag (and root/latest).

    `nvme_offload` (stage 3): the optimizer files hold empty placeholders and the master weights
    and moments go to offloaded_tensors/rank<RR>/ swap files named by ds_ids, as DeepSpeed's
    NVMe optimizer offload saves them.

    Returns what a reader must give back: fp32 weights and "exp_avg/<name>" moments of the
    trainable params, buffers as given, frozen params in the run's low precision, tied aliases.
    """
    buffers, frozen, shared = buffers or {}, frozen or {}, shared or {}
    low = LOW_PRECISION[precision]
    frozen = {k: v.to(low) for k, v in frozen.items()}
    directory = root / tag
    directory.mkdir(parents=True)
    (root / "latest").write_text(tag)
    prefix = "bf16_" if precision == "bf16" else ""
    common = {"buffer_names": list(buffers), "optimizer": None, "shared_params": dict(shared),
              "lr_scheduler": {"last_batch_iteration": 6, "warmup_num_steps": 10},
              "data_sampler": None, "random_ltd": None, "sparse_tensor_module_names": set(),
              "skipped_steps": 0, "global_steps": 7, "global_samples": 56,
              "dp_world_size": world_size, "mp_world_size": 1,
              "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 1},
              "ds_config": DS_CONFIG, "ds_version": "0.19.8"}
    module = {**{k: v.to(low) for k, v in params.items()}, **buffers, **frozen,
              **{alias: params[owner].to(low) for alias, owner in shared.items()}}
    with _deepspeed_classes() as ds:
        scaler = ds.dynamic() if precision == "fp16" else ds.static()
        if stage == 3:
            _write_stage3(directory, params, frozen, module, common, world_size, sub_group_numel,
                          prefix, scaler, ds.stage.weights, nvme_offload)
        else:
            _write_stage12(directory, params, frozen, module, common, world_size, stage,
                           groups or [list(params)], prefix, scaler, ds)
    expected = {**params, **buffers, **frozen}
    expected.update({alias: expected[owner] for alias, owner in shared.items()})
    for name, weight in params.items():
        expected.update({f"{state}/{name}": value for state, value in moments(weight).items()})
    return expected


def _adam_state(step_groups: list[dict[str, torch.Tensor]]) -> dict:
    """A DeepSpeed optimizer's state_dict (FusedAdam / DeepSpeedCPUAdam: an integer step)."""
    return {"state": {i: {"step": 7, **g} for i, g in enumerate(step_groups)},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                              "bias_correction": True, "amsgrad": False, "adamw_mode": True,
                              "step": 0, "params": [i]} for i in range(len(step_groups))]}


def _write_swap_files(directory, rank, sub_groups, ds_ids, flat):
    """DeepSpeed's swap files of one rank: raw fp32, padded with junk to 256 elements."""
    folder = directory / "offloaded_tensors" / f"rank{rank:02d}"
    folder.mkdir(parents=True)
    for i, names in enumerate(sub_groups):
        ident = f"{ds_ids[names[0]]}_{ds_ids[names[-1]]}"
        for kind, prefix in (("fp32", ""), ("exp_avg", "exp_avg-"), ("exp_avg_sq", "exp_avg_sq-")):
            data = flat[kind][i]
            _padded(data, math.ceil(data.numel() / 256) * 256).numpy().tofile(
                folder / f"{prefix}{ident}.tensor.swp")
        # DeepSpeed skips these
        (folder / f"{ident}_gradient_0_8.tensor.swp").write_bytes(b"g" * 32)


def _write_stage3(directory, params, frozen, module, common, n, sub_group_numel, prefix,
                  scaler, stage, nvme_offload):
    sub_groups: list[list[str]] = [[]]
    for name, weight in params.items():  # DeepSpeed cuts sub-groups by sub_group_size
        if (sub_groups[-1]
                and sum(params[k].numel() for k in sub_groups[-1]) + weight.numel()
                > sub_group_numel):
            sub_groups.append([])
        sub_groups[-1].append(name)
    ds_ids = {name: 3 + 2 * i for i, name in enumerate(params)}  # grow in parameter order
    group_ids = [f"{ds_ids[g[0]]}_{ds_ids[g[-1]]}" for g in sub_groups]

    def share(tensor: torch.Tensor, rank: int) -> torch.Tensor:
        p = math.ceil(tensor.numel() / n)
        return _padded(tensor.reshape(-1), p * n)[rank * p:(rank + 1) * p].clone()

    for rank in range(n):
        placeholders = {k: (torch.empty(0, dtype=v.dtype) if k in params or k in frozen or
                            k in common["shared_params"] else v) for k, v in module.items()}
        model_states = {**common, "module": placeholders,
                        "param_shapes": [OrderedDict((k, params[k].shape) for k in g)
                                         for g in sub_groups],
                        "frozen_param_shapes": OrderedDict((k, v.shape) for k, v in frozen.items()),
                        "frozen_param_fragments": OrderedDict((k, share(v, rank))
                                                              for k, v in frozen.items())}
        torch.save(model_states, directory / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt")
        flat = {kind: [torch.cat([share(source(params[k]), rank) for k in g]) for g in sub_groups]
                for kind, source in (("fp32", lambda w: w),
                                     ("exp_avg", lambda w: moments(w)["exp_avg"]),
                                     ("exp_avg_sq", lambda w: moments(w)["exp_avg_sq"]))}
        moment_ids = {"exp_avg": "exp_avg-", "exp_avg_sq": "exp_avg_sq-"}
        if nvme_offload:  # swapped out: empty placeholders keeping their ds_id, data in swap files
            _write_swap_files(directory, rank, sub_groups, ds_ids, flat)
            flat = {kind: [_flat_partition(torch.empty(0), f"{moment_ids.get(kind, '')}{i}")
                           for i in group_ids] for kind in flat}
        fp32 = [_flat_partition(t, i) for t, i in zip(flat["fp32"], group_ids)]
        zero = {"zero_stage": stage, "loss_scaler": scaler, "dynamic_loss_scale": scaler.dynamic,
                "overflow": False, "partition_count": n,
                "optimizer_state_dict": _adam_state([{"exp_avg": a, "exp_avg_sq": b} for a, b in
                                                     zip(flat["exp_avg"], flat["exp_avg_sq"])]),
                "fp32_flat_groups": fp32}
        torch.save({"optimizer_state_dict": zero, "ds_config": DS_CONFIG, "ds_version": "0.19.8"},
                   directory / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")


def _write_stage12(directory, params, frozen, module, common, n, stage, groups, prefix, scaler, ds):
    model_states = {**common, "module": module,
                    "param_shapes": [OrderedDict((k, params[k].shape) for k in g) for g in groups],
                    "frozen_param_shapes": (OrderedDict((k, v.shape) for k, v in frozen.items())
                                            if stage == 2 else None),
                    "frozen_param_fragments": OrderedDict(frozen) if stage == 2 else None}
    torch.save(model_states, directory / "mp_rank_00_model_states.pt")
    flats, paddings = {}, []
    for kind, source in (("fp32", lambda w: w), ("exp_avg", lambda w: moments(w)["exp_avg"]),
                         ("exp_avg_sq", lambda w: moments(w)["exp_avg_sq"])):
        flats[kind] = []
        for g in groups:
            numel = sum(params[k].numel() for k in g)
            aligned = math.ceil(numel / (2 * n)) * 2 * n  # nccl_start_alignment_factor * world size
            flats[kind].append(_padded(torch.cat([source(params[k]).reshape(-1) for k in g]),
                                       aligned))
            if kind == "fp32":
                paddings.append(aligned - numel)
    for rank in range(n):
        parts = {kind: [f[rank * (f.numel() // n):(rank + 1) * (f.numel() // n)].clone()
                        for f in fs]
                 for kind, fs in flats.items()}
        group_paddings = [pad if rank == n - 1 else 0 for pad in paddings]
        slice_mappings = []
        for g, names in enumerate(groups):
            p, start, mapping = flats["fp32"][g].numel() // n, 0, OrderedDict()
            for name in names:
                lo, hi = max(start, rank * p), min(start + params[name].numel(), (rank + 1) * p)
                if lo < hi:
                    mapping[name] = ds.fragment_address(numel=hi - lo, start=lo - rank * p)
                start += params[name].numel()
            slice_mappings.append(mapping)
        # the partitions require grad; the saved ones are views without the padding
        fp32 = [part.requires_grad_(True)[:part.numel() - pad]
                for part, pad in zip(parts["fp32"], group_paddings)]
        zero = {"loss_scaler": scaler, "dynamic_loss_scale": scaler.dynamic, "overflow": False,
                "clip_grad": 1.0,
                "base_optimizer_state": _adam_state([{"exp_avg": a, "exp_avg_sq": b} for a, b in
                                                     zip(parts["exp_avg"], parts["exp_avg_sq"])]),
                "single_partition_of_fp32_groups": fp32,
                "zero_stage": ds.stage.gradients if stage == 2 else ds.stage.optimizer_states,
                "group_paddings": group_paddings, "partition_count": [n] * len(groups),
                "ds_version": "0.19.8", "param_slice_mappings": slice_mappings}
        torch.save({"optimizer_state_dict": zero, "ds_config": DS_CONFIG, "ds_version": "0.19.8"},
                   directory / f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt")
