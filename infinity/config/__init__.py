"""DeepSpeed-compatible configuration: JSON -> typed, validated, frozen sections."""

from infinity.config._activation import ActivationCheckpointingConfig
from infinity.config._config import Config
from infinity.config._ignored import (
    FlopsProfilerConfig,
    MonitorConfig,
    WandbConfig,
)
from infinity.config._load import load_config, read_json
from infinity.config._sections import (
    AdamParams,
    AioConfig,
    AmpConfig,
    BF16Config,
    FP16Config,
    InfinityConfig,
    OptimizerConfig,
    OptimizerStateConfig,
    SchedulerConfig,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
)
from infinity.config._values import parse_bytes
from infinity.config._zero import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig

__all__ = [
    "ActivationCheckpointingConfig",
    "AdamParams",
    "AioConfig",
    "AmpConfig",
    "BF16Config",
    "Config",
    "FP16Config",
    "FlopsProfilerConfig",
    "InfinityConfig",
    "MonitorConfig",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "OptimizerConfig",
    "OptimizerStateConfig",
    "SchedulerConfig",
    "WandbConfig",
    "WarmupCosineLRParams",
    "WarmupDecayLRParams",
    "WarmupLRParams",
    "ZeroConfig",
    "load_config",
    "read_json",
    "parse_bytes",
]
