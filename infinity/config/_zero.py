"""The `zero_optimization` section and its two offload subsections, with DeepSpeed's defaults.

Counts of parameters (`*_size`, `*_threshold`, `*_parameters`, `*_distance`) are in elements, as
in DeepSpeed, not bytes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from infinity.config._section import Section
from infinity.config._values import check

Device = Literal["none", "cpu", "nvme"]

_PER_UNIT = "one collective per unit, issued when the unit needs it: nothing to bucket or tune (docs/scale.md, Ranks)"
_POOL = "the host_memory_budget sizes Infinity's arena and I/O buffers, not per-buffer counts"


def _check_counts(section: object, names: tuple[str, ...], least: int = 0) -> None:
    for name in names:
        value = getattr(section, name)
        check(value >= least, name, value, f"an integer >= {least}")


@dataclass(kw_only=True, frozen=True)
class _Offload(Section):
    """What the two offload subsections share."""

    device: Device = "none"
    """Where the tensors live between uses: "none" (accelerator / plain memory), "cpu" (host
    memory) or "nvme" (files under nvme_path). Default "none"."""
    nvme_path: str | None = None
    """Directory for the swap files; required when device is "nvme". It must exist or be
    creatable, and be writable. Default None."""
    pin_memory: bool = True
    """Page-lock (pin) host buffers for faster accelerator copies. Default true."""

    NO_AUTO: ClassVar[frozenset[str]] = frozenset({"device", "nvme_path"})

    def __post_init__(self) -> None:
        check(self.device != "nvme" or bool(self.nvme_path), "nvme_path", self.nvme_path,
              'a directory: device is "nvme", so nvme_path is required')
        check(self.nvme_path is None or bool(self.nvme_path), "nvme_path", self.nvme_path,
              "a non-empty directory path, or null")


@dataclass(kw_only=True, frozen=True)
class OffloadParamConfig(_Offload):
    """`zero_optimization.offload_param`: where ZeRO-3 keeps parameters between uses."""

    buffer_count: int = 5
    """DeepSpeed: number of pinned swap buffers for parameters. Default 5."""
    buffer_size: int = int(1e8)
    """DeepSpeed: elements per pinned swap buffer. Default 1e8."""
    max_in_cpu: int = int(1e9)
    """DeepSpeed: elements of NVMe-offloaded parameters kept in host memory anyway. Default 1e9."""

    NOT_HONOURED: ClassVar[dict[str, str]] = {
        "buffer_count": _POOL,
        "buffer_size": _POOL + "; a parameter larger than a buffer is no error here",
        "max_in_cpu": "what stays in host memory follows the host_memory_budget and the trace",
    }

    def __post_init__(self) -> None:
        _Offload.__post_init__(self)
        _check_counts(self, ("max_in_cpu",))
        _check_counts(self, ("buffer_count", "buffer_size"), least=1)  # none: nothing could move


@dataclass(kw_only=True, frozen=True)
class OffloadOptimizerConfig(_Offload):
    """`zero_optimization.offload_optimizer`: where the fp32 master and Adam moments live."""

    buffer_count: int = 4
    """DeepSpeed: number of pinned swap buffers for optimizer state. Default 4."""
    pipeline_read: bool = False
    """DeepSpeed: overlap the read of the next sub-group with the step. Default false."""
    pipeline_write: bool = False
    """DeepSpeed: overlap the write of the previous sub-group with the step. Default false."""
    fast_init: bool = False
    """DeepSpeed: initialise NVMe optimizer state from the swapped parameters. Default false."""
    ratio: float = 1.0
    """Fraction of the optimizer state offloaded (DeepSpeed: < 1 needs stage 3). Default 1."""
    super_offload: bool = False
    """DeepSpeed's SuperOffload mode. Default false."""
    cpuadam_cores_perc: float = 0.8
    """DeepSpeed: share of the cores CPU Adam may use. Default 0.8."""

    NOT_HONOURED: ClassVar[dict[str, str]] = {
        "buffer_count": _POOL,
        "pipeline_read": "optimizer tiles are always read ahead (a three-stage pipeline)",
        "pipeline_write": "optimizer tiles are always written behind (a three-stage pipeline)",
        "fast_init": "the optimizer state is created from the parameters in host memory",
        "ratio": "the whole optimizer state goes to the chosen device",
        "super_offload": "the step overlaps backward by Infinity's own scheme (docs/engine.md)",
        "cpuadam_cores_perc": "CPU Adam uses the threads of the pool the engine owns",
    }

    def __post_init__(self) -> None:
        _Offload.__post_init__(self)
        _check_counts(self, ("buffer_count",), least=1)
        check(0.0 <= self.ratio <= 1.0, "ratio", self.ratio, "a number in [0, 1]")
        check(0.0 <= self.cpuadam_cores_perc <= 1.0, "cpuadam_cores_perc",
              self.cpuadam_cores_perc, "a number in [0, 1]")


@dataclass(kw_only=True, frozen=True)
class ZeroConfig(Section):
    """`zero_optimization`: partitioning stage, offload, and the ZeRO-3 prefetch knobs."""

    stage: Literal[0, 1, 2, 3] = 0
    """0: no partitioning; 1: optimizer state; 2: + gradients; 3: + parameters (fetched per
    module). Default 0."""
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    """Parameter offload (stage 3 only)."""
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    """Optimizer-state offload."""
    stage3_max_live_parameters: int = int(1e9)
    """Elements of fetched parameters prefetch may keep live at once. Default 1e9."""
    stage3_max_reuse_distance: int = int(1e9)
    """A parameter used again within this many elements of fetches is kept, not released.
    Default 1e9."""
    stage3_prefetch_bucket_size: int = int(5e7)
    """Elements fetched ahead of use along the trace; 0 turns prefetch off. Default 5e7
    ("auto": 0.9 * hidden_size**2)."""
    stage3_param_persistence_threshold: int = int(1e5)
    """Parameters of at most this many elements stay resident (never offloaded). Default 1e5
    ("auto": 10 * hidden_size)."""
    stage3_model_persistence_threshold: int = sys.maxsize
    """Cap on the total elements kept resident by the threshold above. Default sys.maxsize."""
    stage3_gather_16bit_weights_on_model_save: bool = False
    """Gather the full 16-bit weights when the model is saved. Default false."""
    sub_group_size: int = int(1e9)
    """Elements per optimizer sub-group (DeepSpeed), the most per optimizer tile here
    (SwappedOptimizer's tile_numel). Default 1e9."""
    reduce_bucket_size: int = int(5e8)
    """DeepSpeed: elements per gradient reduction bucket. Default 5e8 ("auto": hidden_size**2)."""
    allgather_bucket_size: int = int(5e8)
    """DeepSpeed: elements per all-gather bucket. Default 5e8."""
    overlap_comm: bool | None = None
    """DeepSpeed: overlap reduction with backward. Default null (true for stage 3)."""
    contiguous_gradients: bool = True
    """DeepSpeed: copy gradients into one contiguous buffer. Default true."""
    reduce_scatter: bool = True
    """DeepSpeed: reduce gradients with reduce-scatter. Default true."""
    allgather_partitions: bool = True
    """DeepSpeed: all-gather partitions rather than broadcast. Default true."""
    round_robin_gradients: bool = False
    """DeepSpeed: stage 1/2 round-robin gradient partitioning. Default false."""
    elastic_checkpoint: bool = False
    """DeepSpeed: elastic checkpoints (deprecated there). Default false."""
    ignore_unused_parameters: bool = True
    """DeepSpeed: tolerate parameters without gradients in stage 1/2. Default true."""
    memory_efficient_linear: bool = True
    """DeepSpeed: its own linear autograd function under stage 3. Default true."""
    load_from_fp32_weights: bool = True
    """DeepSpeed: restore fp16 weights from the fp32 master on load. Default true."""
    use_multi_rank_bucket_allreduce: bool = True
    """DeepSpeed: bucketed all-reduce across ranks. Default true."""
    stage3_module_granularity_threshold: int = 0
    """DeepSpeed: merge small modules into one fetch unit. Default 0."""
    stage3_use_all_reduce_for_fetch_params: bool = False
    """DeepSpeed: fetch parameters with all-reduce. Default false."""
    stage3_allgather_sequential: bool = False
    """DeepSpeed: gather parameters one by one. Default false."""
    zero_hpz_partition_size: int = 1
    """DeepSpeed ZeRO++: secondary partition size. Default 1."""
    zero_quantized_weights: bool = False
    """DeepSpeed ZeRO++: quantized weight communication. Default false."""
    zero_quantized_nontrainable_weights: bool = False
    """DeepSpeed ZeRO++: quantized frozen weights. Default false."""
    zero_quantized_gradients: bool = False
    """DeepSpeed ZeRO++: quantized gradient communication. Default false."""
    mics_shard_size: int = -1
    """DeepSpeed MiCS: shard group size. Default -1."""
    mics_hierarchical_params_gather: bool = False
    """DeepSpeed MiCS: hierarchical gather. Default false."""
    pipeline_loading_checkpoint: bool = False
    """DeepSpeed: pipelined checkpoint loading. Default false."""
    override_module_apply: bool = True
    """DeepSpeed: gather parameters inside module.apply. Default true."""
    log_trace_cache_warnings: bool = False
    """DeepSpeed: print trace invalidations. Default false."""
    enable_sanity_checks: bool = False
    """DeepSpeed: extra stage-3 consistency checks. Default false."""
    legacy_stage1: bool = False
    """DeepSpeed: the old stage-1 implementation. Default false."""
    save_muon_momentum_buffer_in_memory: bool = False
    """DeepSpeed: keep Muon momentum out of NVMe. Default false."""

    NOT_HONOURED: ClassVar[dict[str, str]] = {
        "reduce_bucket_size": _PER_UNIT,
        "allgather_bucket_size": _PER_UNIT,
        "overlap_comm": _PER_UNIT,
        "reduce_scatter": _PER_UNIT,
        "allgather_partitions": _PER_UNIT,
        "round_robin_gradients": _PER_UNIT,
        "use_multi_rank_bucket_allreduce": _PER_UNIT,
        "stage3_use_all_reduce_for_fetch_params": _PER_UNIT,
        "stage3_allgather_sequential": _PER_UNIT,
        "zero_hpz_partition_size": _PER_UNIT,
        "zero_quantized_weights": "ZeRO++ quantized communication: " + _PER_UNIT,
        "zero_quantized_nontrainable_weights": "ZeRO++ quantized communication: " + _PER_UNIT,
        "zero_quantized_gradients": "ZeRO++ quantized communication: " + _PER_UNIT,
        "mics_shard_size": "MiCS sharding: " + _PER_UNIT,
        "mics_hierarchical_params_gather": "MiCS sharding: " + _PER_UNIT,
        "contiguous_gradients": "gradients already go to one host buffer per fetch unit",
        "elastic_checkpoint": "checkpoints are rank-independent by design",
        "load_from_fp32_weights": "a checkpoint always restores the fp32 master",
        "pipeline_loading_checkpoint": "checkpoints stream with bounded memory anyway",
        "ignore_unused_parameters": "unused parameters are fine when every rank leaves the same ones unused (docs/scale.md, Ranks)",
        "memory_efficient_linear": "ordinary autograd; hooks fetch parameters per module",
        "override_module_apply": "Infinity does not patch module.apply",
        "stage3_module_granularity_threshold": "the fetch unit is one module's parameters",
        "log_trace_cache_warnings": "there is no trace-cache warning to switch on",
        "enable_sanity_checks": "there are no optional stage-3 checks to switch on",
        "legacy_stage1": "there is one implementation of each stage",
        "save_muon_momentum_buffer_in_memory": "Infinity has no Muon optimizer",
    }
    ALIASES: ClassVar[dict[str, str]] = {
        "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    }
    NO_AUTO: ClassVar[frozenset[str]] = frozenset({"stage"})
    OPAQUE: ClassVar[dict[str, str]] = {
        "zenflow": "DeepSpeed's ZenFlow asynchronous update is not implemented",
        "zeropp_loco_param": "ZeRO++ LoCo: " + _PER_UNIT,
        "leaf_module": "the fetch unit is always one module's parameters",
    }

    def __post_init__(self) -> None:
        _check_counts(self, ("stage3_max_live_parameters", "stage3_max_reuse_distance",
                             "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                             "stage3_model_persistence_threshold",
                             "reduce_bucket_size", "allgather_bucket_size",
                             "stage3_module_granularity_threshold", "zero_hpz_partition_size"))
        _check_counts(self, ("sub_group_size",), least=1)  # elements per optimizer tile
        check(self.stage == 3 or self.offload_param.device == "none", "offload_param.device",
              self.offload_param.device,
              f'"none" with stage {self.stage}: DeepSpeed offloads parameters only under ZeRO '
              "stage 3; set zero_optimization.stage to 3")
        check(self.stage == 3 or self.offload_optimizer.ratio == 1.0, "offload_optimizer.ratio",
              self.offload_optimizer.ratio,
              f"1.0 with stage {self.stage}: partial offload (ratio < 1) needs ZeRO stage 3")
