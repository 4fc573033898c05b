"""The config sections other than ZeRO: optimizer, scheduler, precision, aio, and Infinity's own.

Field names are DeepSpeed's JSON keys; defaults are DeepSpeed's (its code, where docs differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from infinity.config._section import Section
from infinity.config._values import ByteSize, FieldError, check

# -- optimizer ---------------------------------------------------------------------------------

_DEEPSPEED_ONLY_OPTIMIZERS = ("adagrad", "lamb", "onebitadam", "onebitlamb", "zerooneadam",
                              "lion", "muon", "muadam", "muadamw", "musgd", "fusedadam",
                              "cpu_adam", "deepspeedcpuadam", "cpuadam")


@dataclass(kw_only=True, frozen=True)
class AdamParams(Section):
    """`optimizer.params` for Adam and AdamW (DeepSpeed passes them to its Adam kernels)."""

    lr: float = 1e-3
    """Learning rate. Default 1e-3 ("auto": the Trainer's 5e-5)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's (beta1, beta2), each in [0, 1). Default [0.9, 0.999]."""
    eps: float = 1e-8
    """Added to the denominator, after bias correction. Default 1e-8."""
    weight_decay: float = 0.0
    """Weight decay. Default 0."""
    adam_w_mode: bool = True
    """Decoupled weight decay for type "Adam" (DeepSpeed's default makes "Adam" run as AdamW).
    Default true."""
    torch_adam: bool = False
    """DeepSpeed: use torch's Adam instead of its fused kernel. Default false."""
    amsgrad: bool = False
    """AMSGrad variant; not supported (must be false). Default false."""
    bias_correction: bool = True
    """Adam's bias correction; always on here (must be true). Default true."""

    NOT_HONOURED: ClassVar[dict[str, str]] = {
        "torch_adam": "the update always runs Infinity's CPU Adam kernel (same math as torch)",
    }

    def __post_init__(self) -> None:
        check(self.lr >= 0, "lr", self.lr, "a number >= 0")
        check(all(0.0 <= b < 1.0 for b in self.betas), "betas", list(self.betas),
              "two numbers, each in [0, 1)")
        check(self.eps >= 0, "eps", self.eps, "a number >= 0")
        check(self.weight_decay >= 0, "weight_decay", self.weight_decay, "a number >= 0")
        check(not self.amsgrad, "amsgrad", self.amsgrad, "false: CPU Adam has no AMSGrad")
        check(self.bias_correction, "bias_correction", self.bias_correction,
              "true: CPU Adam always applies bias correction")


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig(Section):
    """`optimizer`: Adam or AdamW (run by Infinity's CPU Adam, as DeepSpeed runs DeepSpeedCPUAdam
    under offload)."""

    type: Literal["Adam", "AdamW"]
    """"Adam" or "AdamW" (any case, as DeepSpeed accepts)."""
    params: AdamParams = field(default_factory=AdamParams)
    """The hyperparameters."""

    NO_AUTO: ClassVar[frozenset[str]] = frozenset({"type"})
    OPAQUE: ClassVar[dict[str, str]] = {
        "legacy_fusion": "DeepSpeed's fused fp16 optimizer wrapper does not exist here"}
    TYPES: ClassVar[dict[str, str]] = {"adam": "Adam", "adamw": "AdamW"}

    @classmethod
    def canonical_type(cls, name: str) -> str | None:
        return cls.TYPES.get(name.lower())

    @staticmethod
    def params_class(type_name: str) -> type[Section]:
        return AdamParams

    @classmethod
    def type_error(cls, name: str) -> str:
        if name.lower() in _DEEPSPEED_ONLY_OPTIMIZERS:
            return (f"one of {', '.join(map(repr, cls.TYPES.values()))}: {name!r} is a DeepSpeed "
                    "optimizer Infinity does not implement (Adam and AdamW run on its CPU Adam)")
        return f"one of {', '.join(map(repr, cls.TYPES.values()))}"

    @property
    def decoupled_weight_decay(self) -> bool:
        """AdamW-style decay: type AdamW, or type Adam with adam_w_mode (DeepSpeed's rule)."""
        return self.type == "AdamW" or self.params.adam_w_mode


# -- scheduler ---------------------------------------------------------------------------------

@dataclass(kw_only=True, frozen=True)
class _WarmupParams(Section):
    warmup_num_steps: int = 1000
    """Steps of warmup (DeepSpeed uses at least 2). Default 1000 ("auto": the Trainer's 0)."""
    warmup_type: Literal["log", "linear"] = "log"
    """Shape of the warmup ramp. Default "log"."""
    last_batch_iteration: int = -1
    """DeepSpeed: the step to start from when resuming. Default -1."""

    NOT_HONOURED: ClassVar[dict[str, str]] = {
        "last_batch_iteration": "the engine's step count (restored from a checkpoint) is the "
                                "schedule's position",
    }

    def __post_init__(self) -> None:
        check(self.warmup_num_steps >= 0, "warmup_num_steps", self.warmup_num_steps,
              "an integer >= 0")

    def _check_total(self, total: int | None) -> None:
        check(total is None or total > 0, "total_num_steps", total, "an integer > 0")
        check(total is None or total >= self.warmup_num_steps, "total_num_steps", total,
              f"at least warmup_num_steps ({self.warmup_num_steps}): the decay would end "
              "before the warmup does")


@dataclass(kw_only=True, frozen=True)
class WarmupLRParams(_WarmupParams):
    """`scheduler.params` of WarmupLR: ramp from warmup_min_lr to warmup_max_lr, then hold."""

    warmup_min_lr: float = 0.0
    """Learning rate at the start of warmup. Default 0."""
    warmup_max_lr: float | None = None
    """Learning rate after warmup. Default null: the optimizer's lr (DeepSpeed's WarmupLR)."""

    def __post_init__(self) -> None:
        _WarmupParams.__post_init__(self)
        check(self.warmup_min_lr >= 0, "warmup_min_lr", self.warmup_min_lr, "a number >= 0")
        check(self.warmup_max_lr is None or self.warmup_max_lr >= self.warmup_min_lr,
              "warmup_max_lr", self.warmup_max_lr,
              f"a number >= warmup_min_lr ({self.warmup_min_lr})")


@dataclass(kw_only=True, frozen=True)
class WarmupDecayLRParams(WarmupLRParams):
    """`scheduler.params` of WarmupDecayLR: WarmupLR, then linear decay to 0 at total_num_steps."""

    warmup_max_lr: float | None = 1e-3
    """Learning rate after warmup. Default 0.001 (DeepSpeed's WarmupDecayLR, unlike WarmupLR,
    does not default to the optimizer's lr)."""
    total_num_steps: int | None = None
    """Step at which the learning rate reaches 0. Required; null ("auto": the Trainer's
    max_steps) must be given when the schedule is built."""

    def __post_init__(self) -> None:
        WarmupLRParams.__post_init__(self)
        self._check_total(self.total_num_steps)


@dataclass(kw_only=True, frozen=True)
class WarmupCosineLRParams(_WarmupParams):
    """`scheduler.params` of WarmupCosineLR: ratios of the optimizer's lr."""

    total_num_steps: int | None = None
    """Step at which the cosine reaches cos_min_ratio. Required; null ("auto") must be given
    when the schedule is built."""
    warmup_min_ratio: float = 0.0
    """Ratio of the optimizer's lr at the start of warmup. Default 0."""
    cos_min_ratio: float = 1e-4
    """Ratio of the optimizer's lr at the end of the cosine. Default 0.0001."""

    def __post_init__(self) -> None:
        _WarmupParams.__post_init__(self)
        self._check_total(self.total_num_steps)
        for name in ("warmup_min_ratio", "cos_min_ratio"):
            check(0.0 <= getattr(self, name) <= 1.0, name, getattr(self, name),
                  "a number in [0, 1]")


SchedulerParams = WarmupLRParams | WarmupDecayLRParams | WarmupCosineLRParams


@dataclass(kw_only=True, frozen=True)
class SchedulerConfig(Section):
    """`scheduler`: one of DeepSpeed's warmup schedules; the engine steps it once per update."""

    type: Literal["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"]
    """The schedule (names as in DeepSpeed, case-sensitive)."""
    params: SchedulerParams = field(default_factory=WarmupLRParams)
    """The schedule's parameters; which keys are valid depends on `type`."""

    NO_AUTO: ClassVar[frozenset[str]] = frozenset({"type"})
    TYPES: ClassVar[dict[str, str]] = {"WarmupLR": "WarmupLR", "WarmupDecayLR": "WarmupDecayLR",
                                       "WarmupCosineLR": "WarmupCosineLR"}

    @classmethod
    def canonical_type(cls, name: str) -> str | None:
        return cls.TYPES.get(name)

    @staticmethod
    def params_class(type_name: str) -> type[Section]:
        return {"WarmupLR": WarmupLRParams, "WarmupDecayLR": WarmupDecayLRParams,
                "WarmupCosineLR": WarmupCosineLRParams}[type_name]

    @classmethod
    def type_error(cls, name: str) -> str:
        if name in ("LRRangeTest", "OneCycle"):
            return (f"one of {', '.join(cls.TYPES)}: DeepSpeed's {name} is not implemented")
        return f"one of {', '.join(cls.TYPES)} (case-sensitive, as in DeepSpeed)"

    def __post_init__(self) -> None:
        expected = self.params_class(self.type)
        if type(self.params) is not expected:
            raise FieldError("params", self.params, f"{expected.__name__} for type {self.type!r}")


# -- precision ---------------------------------------------------------------------------------

@dataclass(kw_only=True, frozen=True)
class FP16Config(Section):
    """`fp16`: half-precision parameters with loss scaling (0 = dynamic)."""

    enabled: bool = False
    """Train with fp16 parameters and a loss scale. Default false ("auto": false)."""
    auto_cast: bool = False
    """DeepSpeed: cast floating-point inputs to fp16. Default false."""
    loss_scale: float = 0.0
    """A fixed loss scale; 0 means dynamic scaling. Default 0."""
    initial_scale_power: int = 16
    """Dynamic scaling starts at 2**initial_scale_power. Default 16."""
    loss_scale_window: int = 1000
    """Clean steps before the dynamic scale doubles. Default 1000."""
    hysteresis: int = 2
    """Overflows tolerated before the dynamic scale halves. Default 2."""
    consecutive_hysteresis: bool = False
    """DeepSpeed: refill hysteresis after every clean step. Default false."""
    min_loss_scale: float = 1.0
    """The dynamic scale never drops below this. Default 1."""
    fp16_master_weights_and_grads: bool = False
    """DeepSpeed: keep master weights in fp16. Default false."""

    NOT_HONOURED: ClassVar[dict[str, str]] = {
        "auto_cast": "inputs reach the model as given; the engine casts parameters, not inputs",
        "consecutive_hysteresis": "the loss scaler refills hysteresis only when the scale moves",
        "fp16_master_weights_and_grads": "the master weights are always fp32",
    }

    def __post_init__(self) -> None:
        check(self.loss_scale >= 0, "loss_scale", self.loss_scale,
              "a number >= 0 (0 means dynamic loss scaling)")
        check(0 <= self.initial_scale_power <= 64, "initial_scale_power",
              self.initial_scale_power, "an integer in [0, 64]")
        check(self.loss_scale_window >= 1, "loss_scale_window", self.loss_scale_window,
              "an integer >= 1")
        check(self.hysteresis >= 1, "hysteresis", self.hysteresis, "an integer >= 1")
        check(self.min_loss_scale > 0, "min_loss_scale", self.min_loss_scale, "a number > 0")

    @property
    def dynamic(self) -> bool:
        """Dynamic loss scaling (loss_scale 0)."""
        return self.loss_scale == 0

    @property
    def initial_scale(self) -> float:
        """The first loss scale: 2**initial_scale_power if dynamic, else loss_scale."""
        return 2.0**self.initial_scale_power if self.dynamic else self.loss_scale


@dataclass(kw_only=True, frozen=True)
class BF16Config(Section):
    """`bf16` (alias `bfloat16`): bfloat16 parameters, fp32 master weights, no loss scale."""

    enabled: bool = False
    """Train with bf16 parameters. Default false ("auto": false)."""
    check_grad_overflow: bool = True
    """DeepSpeed: skip the step when a gradient is inf/nan. Default true."""
    immediate_grad_update: bool = False
    """DeepSpeed: apply gradient updates immediately. Default false."""
    bf16_master_weights_and_grads: bool = False
    """DeepSpeed: keep master weights and grads in bf16. Default false."""
    bf16_optimizer_states: bool = False
    """DeepSpeed: keep Adam moments in bf16. Default false."""

    NOT_HONOURED: ClassVar[dict[str, str]] = {
        "immediate_grad_update": "gradients go to the optimizer when their unit's backward ends",
        "check_grad_overflow": "every gradient is always checked for inf/nan, and a non-finite "
                               "one fails the step (as in fp32) instead of skipping it",
        "bf16_master_weights_and_grads": 'the master weights are fp32, or none with '
                                         'infinity.optimizer_state.master "none"',
        "bf16_optimizer_states": 'bf16 Adam moments are infinity.optimizer_state.moments '
                                 '"bf16"',
    }


@dataclass(kw_only=True, frozen=True)
class AmpConfig(Section):
    """`amp`: NVIDIA apex AMP, which Infinity does not support (must stay disabled)."""

    enabled: bool = False
    """Must be false: use fp16 or bf16 instead. Default false ("auto": false)."""
    opt_level: str = "O1"
    """apex's optimisation level. Default "O1"."""

    def __post_init__(self) -> None:
        check(not self.enabled, "enabled", self.enabled,
              'false: apex AMP is not supported; use "fp16" or "bf16" instead')


# -- asynchronous I/O --------------------------------------------------------------------------

@dataclass(kw_only=True, frozen=True)
class AioConfig(Section):
    """`aio`: settings of the NVMe I/O handles (mapped onto `aio.Handle`)."""

    block_size: int = 1 << 20
    """Bytes per I/O request piece; a multiple of 4096 up to 1 GiB. Default 1048576."""
    queue_depth: int = 8
    """Requests in flight per thread, 1..4096. Default 8."""
    intra_op_parallelism: int = 1
    """I/O threads per handle, 1..64 (alias: thread_count). Default 1."""
    single_submit: bool = False
    """DeepSpeed: one submit system call per request. Default false."""
    overlap_events: bool = True
    """DeepSpeed: keep the queue full while waiting. Default true."""
    use_gds: bool = False
    """GPUDirect Storage; not supported (must be false). Default false."""

    ALIASES: ClassVar[dict[str, str]] = {"thread_count": "intra_op_parallelism",
                                         "num_threads": "intra_op_parallelism"}
    NOT_HONOURED: ClassVar[dict[str, str]] = {
        "single_submit": "requests are batched into one submission as the backend allows",
        "overlap_events": "completions are always reaped while the queue is refilled",
    }

    def __post_init__(self) -> None:
        check(0 < self.block_size <= 1 << 30 and self.block_size % 4096 == 0, "block_size",
              self.block_size, "a multiple of 4096 bytes, at most 1 GiB")
        check(1 <= self.queue_depth <= 4096, "queue_depth", self.queue_depth,
              "an integer in 1..4096")
        check(1 <= self.intra_op_parallelism <= 64, "intra_op_parallelism",
              self.intra_op_parallelism, "an integer in 1..64")
        check(not self.use_gds, "use_gds", self.use_gds,
              "false: GPUDirect Storage (GDS) is not supported; NVMe I/O goes through host "
              "memory")

    def handle_options(self) -> dict[str, int]:
        """Keyword arguments for `aio.Handle` (add `backend=config.infinity.aio_backend`)."""
        return {"block_size": self.block_size, "queue_depth": self.queue_depth,
                "threads": self.intra_op_parallelism}


# -- Infinity's own keys -----------------------------------------------------------------------

@dataclass(kw_only=True, frozen=True)
class OptimizerStateConfig(Section):
    """`infinity.optimizer_state`: how the Adam state is stored (docs/engine.md "Optimizer
    state formats")."""

    moments: Literal["fp32", "bf16", "int8"] = "fp32"
    """exp_avg and exp_avg_sq: "fp32" (8 bytes per parameter), "bf16" (4) or "int8" (8-bit
    codes in blocks of 256 scaled by their largest magnitude: about 2). Default "fp32"."""
    master: Literal["fp32", "none"] = "fp32"
    """"fp32": an fp32 copy of bf16/fp16 parameters (4 bytes per parameter); "none": the
    16-bit parameters are updated in place with seeded stochastic rounding (needs bf16 or fp16;
    fp32 parameters are their own master). Default "fp32"."""


@dataclass(kw_only=True, frozen=True)
class InfinityConfig(Section):
    """`infinity`: keys DeepSpeed does not have."""

    host_memory_budget: ByteSize | None = None
    """Bytes of host memory the engine may allocate (arenas, pools, gradients, optimizer
    tiles); an integer or a string such as "8GB" or "512MiB". What the memory plan leaves of it
    caches what lives on NVMe (parameters, then optimizer state, up to all of them). Absent,
    null or "auto": 80% of the memory available when the config is loaded. None only on a
    config built by hand."""
    trace_prefetch: bool = True
    """Record the order of fetches in step 1 and prefetch along it afterwards. Default true."""
    compute_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Dtype of forward/backward math: "auto" picks the fast one on this machine (bf16
    parameters may compute in fp32 on CPUs without bf16 units); otherwise fp32 or the
    parameter dtype. Default "auto"."""
    checksum: bool = False
    """Verify a checksum of every tensor read back from NVMe. Default false."""
    aio_backend: Literal["auto", "libaio", "io_uring", "threads"] = "auto"
    """The aio backend: "auto" probes once and logs the pick. Default "auto"."""
    collective_timeout: float = 300.0
    """Seconds a collective across data-parallel ranks may take before every rank stops with
    a RankError (a dead or stuck peer). Used when the engine starts the process group itself.
    Default 300."""
    mmap_threshold: ByteSize | Literal["auto"] | None = "auto"
    """glibc malloc: allocations of at least this many bytes get their own mapping, returned
    to the OS when freed, so peak RSS follows what training holds (infinity/memory/malloc.py);
    at most "32MiB". null leaves malloc as it is. Set for the whole process by initialize.
    Default "auto": "8MiB" when parameters or optimizer state live on NVMe (host memory is
    what the offload saves; below 8 MiB, the 1 MiB activations reuse the heap instead of
    being faulted in afresh: ~10% of the 294M GPT's NVMe step's CPU against "1MiB"), else
    null (every freed large block would come back as fresh pages to fault in: measured ~0.3 s
    of a 2.3 s step with everything in RAM)."""

    optimizer_state: OptimizerStateConfig = field(default_factory=OptimizerStateConfig)
    """How the Adam state is stored: see OptimizerStateConfig. Default fp32 moments and
    master."""
    speculate: Literal["auto", "always"] = "auto"
    """When the overlapped optimizer steps units during backward speculatively: "auto" skips
    the step after one where clipping acted (it would most likely be rolled back and redone;
    the units are stepped once the step is validated, in the tail), "always" every step. The
    results are the same bit for bit. Default "auto"."""
    nvme_keep_free: ByteSize = 0
    """Bytes of the disk under nvme_path that the swap file leaves free beside its 1/64 slack,
    for what the run writes next to it (infinity-train sets the size of its export when
    --output is on that disk): only the room a speculated step keeps its old state in gives
    way. Default 0."""
    overlap_optimizer: bool | Literal["auto"] = "auto"
    """Step each unit's optimizer on a worker as soon as its gradients are final, while
    backward goes on, speculatively (with clipping or fp16 too: the step is validated when
    backward ends, then committed or rolled back). Default "auto": where the step waits on
    something other than the cores backward computes on (NVMe, an accelerator); with CPU
    compute and everything in RAM the two would only take turns on the same cores (measured
    slower, docs/performance.md)."""

    def __post_init__(self) -> None:
        budget = self.host_memory_budget
        check(budget is None or budget > 0, "host_memory_budget", budget, "a byte count > 0")
        check(self.collective_timeout > 0, "collective_timeout", self.collective_timeout,
              "seconds > 0")
        check(self.nvme_keep_free >= 0, "nvme_keep_free", self.nvme_keep_free, "a byte count >= 0")
        threshold = self.mmap_threshold
        check(threshold in (None, "auto") or 0 < threshold <= 32 << 20, "mmap_threshold", threshold,
              'a byte count in (0, "32MiB"], "auto" or null')
