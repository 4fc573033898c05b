"""The whole configuration: DeepSpeed's top-level keys, its sections, and the `infinity` section.

Components receive their section (`config.zero_optimization`, `config.aio`), never the raw dict.
Build one with `load_config`; constructing `Config` by hand skips "auto" filling and the path
checks, but not the validation below.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from infinity.config._activation import ActivationCheckpointingConfig
from infinity.config._ignored import (
    FlopsProfilerConfig,
    MonitorConfig,
    WandbConfig,
)
from infinity.config._section import Section
from infinity.config._sections import (
    AioConfig,
    AmpConfig,
    BF16Config,
    FP16Config,
    InfinityConfig,
    OptimizerConfig,
    SchedulerConfig,
)
from infinity.config._values import FieldError, check
from infinity.config._zero import ZeroConfig

_SUMMED_ONCE = ("gradients are summed over the ranks in their own dtype, then divided once "
                "(docs/scale.md, Ranks)")
_OPAQUE_FEATURE = "a DeepSpeed feature Infinity does not have; the section is not read"


@dataclass(kw_only=True, frozen=True)
class Config(Section):
    """A validated DeepSpeed-style config. Field names are DeepSpeed's JSON keys.

    Batch sizes: `train_micro_batch_size_per_gpu` and `train_batch_size` are None while they
    are unresolved until the first batch ("auto", or not given); `batch_pending` says so, and
    the engine calls `with_micro_batch(n)` with the first batch's size.
    """

    train_batch_size: int | None = None
    """Samples per optimizer update over all ranks: micro * accumulation * world_size. None:
    from the first batch."""
    train_micro_batch_size_per_gpu: int | None = None
    """Samples per forward/backward per rank. None: from the first batch."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer update. Default 1 (also "auto": the Trainer's 1)."""
    gradient_clipping: float = 0.0
    """Global gradient-norm clip; 0 turns clipping off. Default 0 ("auto": the Trainer's 1.0)."""
    optimizer: OptimizerConfig | None = None
    """The optimizer; None when the JSON has no `optimizer` section (the engine's default)."""
    scheduler: SchedulerConfig | None = None
    """The learning-rate schedule; None: constant learning rate."""
    fp16: FP16Config = field(default_factory=FP16Config)
    """fp16 training and loss scaling."""
    bf16: BF16Config = field(default_factory=BF16Config)
    """bf16 training (JSON alias `bfloat16`)."""
    amp: AmpConfig = field(default_factory=AmpConfig)
    """apex AMP (must stay disabled)."""
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO stage, offload, prefetch."""
    aio: AioConfig = field(default_factory=AioConfig)
    """NVMe I/O handle settings."""
    infinity: InfinityConfig = field(default_factory=InfinityConfig)
    """Infinity's own keys."""
    steps_per_print: int = 10
    """Log a progress line every this many optimizer steps. Default 10."""
    wall_clock_breakdown: bool = False
    """Time forward, backward and step separately. Default false."""
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = None
    """DeepSpeed: dtype of gradient communication. Default null."""
    gradient_predivide_factor: float = 1.0
    """DeepSpeed: divide gradients by this before the all-reduce. Default 1."""
    prescale_gradients: bool = False
    """DeepSpeed: scale gradients before the all-reduce. Default false."""
    sparse_gradients: bool = False
    """DeepSpeed: sparse embedding gradients. Default false."""
    zero_allow_untested_optimizer: bool = False
    """DeepSpeed: allow a client optimizer under ZeRO. Default false."""
    zero_force_ds_cpu_optimizer: bool = True
    """DeepSpeed: require its CPU Adam under offload. Default true."""
    dump_state: bool = False
    """DeepSpeed: print the engine state after initialisation. Default false."""
    memory_breakdown: bool = False
    """DeepSpeed: print memory use at points of the step. Default false."""
    activation_checkpointing: ActivationCheckpointingConfig = field(
        default_factory=ActivationCheckpointingConfig)
    """For infinity.recompute.run (docs/scale.md, "Activation memory")."""
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)
    """Accepted, not acted on."""
    tensorboard: MonitorConfig = field(default_factory=MonitorConfig)
    """Accepted, not acted on."""
    csv_monitor: MonitorConfig = field(default_factory=MonitorConfig)
    """Accepted, not acted on."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Accepted, not acted on."""
    world_size: int = 1
    """Data-parallel ranks (not a JSON key: given to load_config)."""
    auto_filled: tuple[str, ...] = ()
    """What load_config filled for "auto" or absent values, as 'key=value (source)'."""
    not_honoured: tuple[str, ...] = ()
    """The accepted-but-not-honoured keys present in the JSON, as 'key (reason)'."""

    INTERNAL: ClassVar[frozenset[str]] = frozenset({"world_size", "auto_filled", "not_honoured"})
    ALIASES: ClassVar[dict[str, str]] = {"bfloat16": "bf16"}
    NOT_HONOURED: ClassVar[dict[str, str]] = {
        "communication_data_type": _SUMMED_ONCE,
        "gradient_predivide_factor": _SUMMED_ONCE,
        "prescale_gradients": _SUMMED_ONCE,
        "sparse_gradients": "gradients are dense (embedding gradients included)",
        "zero_allow_untested_optimizer": "the optimizer always runs Infinity's CPU Adam (a "
                                         "client's torch Adam/AdamW is taken over, docs/hf.md)",
        "zero_force_ds_cpu_optimizer": "the optimizer always runs Infinity's CPU Adam (a "
                                       "client's torch Adam/AdamW is taken over, docs/hf.md)",
        "dump_state": "logging.getLogger('infinity') at DEBUG shows the state",
        "memory_breakdown": "engine.stats() reports peak host memory",
    }
    OPAQUE: ClassVar[dict[str, str]] = {
        **{name: _OPAQUE_FEATURE for name in (
            "autotuning", "comms_logger", "comet", "compression_training", "curriculum_learning",
            "data_efficiency", "elasticity", "sparse_attention", "hybrid_engine",
            "tensor_parallel", "expert_parallel", "use_data_before_expert_parallelism",
            "pipeline", "nebula", "aim", "weight_quantization", "quantize_training",
            "eigenvalue", "progressive_layer_drop", "compile", "graph_harvesting",
            "vocabulary_size", "timers", "monitor_config")},
        **{name: _SUMMED_ONCE for name in (
            "disable_allgather", "gradient_allreduce_op", "seq_parallel_communication_data_type")},
        "checkpoint": "checkpoint options are arguments of the engine's save and load",
        "data_types": "gradients accumulate in the parameter dtype",
        "torch_autocast": "the compute dtype is infinity.compute_dtype",
        "managed_gradient_accumulation": "the update happens at the boundaries that "
                                         "gradient_accumulation_steps sets",
        "dataloader_drop_last": "infinity.deepspeed's training loader keeps the last short batch",
        "log_level": "configure logging.getLogger('infinity') in the application",
    }

    def __post_init__(self) -> None:
        check(self.world_size >= 1, "world_size", self.world_size, "an integer >= 1")
        self._check_batch()
        check(self.gradient_clipping >= 0, "gradient_clipping", self.gradient_clipping,
              "a number >= 0 (0 turns clipping off)")
        check(self.steps_per_print >= 1, "steps_per_print", self.steps_per_print,
              "an integer >= 1")
        check(not (self.fp16.enabled and self.bf16.enabled), "fp16.enabled", True,
              "false while bf16.enabled is true: choose one of fp16 and bf16")
        compute = self.infinity.compute_dtype
        check(compute in ("auto", "fp32", self.precision), "infinity.compute_dtype", compute,
              f'"auto", "fp32" or the parameter dtype ("{self.precision}"); a compute dtype '
              "narrower than the parameters loses their precision")
        check(self.infinity.optimizer_state.master == "fp32" or self.precision != "fp32",
              "infinity.optimizer_state.master", "none",
              '"fp32" with fp32 parameters: they are their own master, so master is moot '
              '(master "none" needs bf16.enabled or fp16.enabled)')

    def _check_batch(self) -> None:
        for name in ("train_batch_size", "train_micro_batch_size_per_gpu",
                     "gradient_accumulation_steps"):
            value = getattr(self, name)
            check(value is None or value > 0, name, value, "an integer > 0")
        tbs, micro = self.train_batch_size, self.train_micro_batch_size_per_gpu
        gas, world = self.gradient_accumulation_steps, self.world_size
        if tbs is not None and micro is not None and tbs != micro * gas * world:
            raise FieldError("train_batch_size", tbs,
                             f"train_micro_batch_size_per_gpu * gradient_accumulation_steps * "
                             f"world_size = {micro} * {gas} * {world} = {micro * gas * world}")
        check(tbs is None or micro is not None, "train_micro_batch_size_per_gpu", micro,
              "known when train_batch_size is (load_config derives it)")

    # -- what components read ------------------------------------------------------------------

    @property
    def precision(self) -> Literal["fp32", "fp16", "bf16"]:
        """The parameter (storage) dtype: fp16 or bf16 when enabled, else fp32."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    @property
    def batch_pending(self) -> bool:
        """True while the micro-batch size waits for the first batch."""
        return self.train_micro_batch_size_per_gpu is None

    def with_micro_batch(self, micro_batch_size: int) -> Config:
        """This config with the batch sizes the first batch decides; unchanged when known.

        Raises ConfigError if `micro_batch_size` is not a positive int.
        """
        if not self.batch_pending:
            return self
        check(isinstance(micro_batch_size, int) and micro_batch_size > 0,
              "train_micro_batch_size_per_gpu", micro_batch_size,
              "a positive integer (the first batch's size)")
        return dataclasses.replace(
            self, train_micro_batch_size_per_gpu=micro_batch_size,
            train_batch_size=micro_batch_size * self.gradient_accumulation_steps * self.world_size)
