"""Optimizers that run where the state is: CPU Adam / AdamW over host (and swapped) tensors."""

from infinity.optim._format import SegmentState, StateFormat, TileLayout
from infinity.optim._native import StateKernel, adam_step, available_isas, resolve_isa, sum_squares
from infinity.optim.cpu_adam import CPUAdam
from infinity.optim.loss_scaler import DynamicLossScaler
from infinity.optim.lr_schedule import LRSchedule, WarmupCosineLR, WarmupDecayLR, WarmupLR
from infinity.optim.swapped import DecaySpan, SwappedOptimizer, UnitSpec

__all__ = [
    "CPUAdam",
    "DecaySpan",
    "DynamicLossScaler",
    "LRSchedule",
    "SegmentState",
    "StateFormat",
    "StateKernel",
    "SwappedOptimizer",
    "TileLayout",
    "UnitSpec",
    "WarmupCosineLR",
    "WarmupDecayLR",
    "WarmupLR",
    "adam_step",
    "available_isas",
    "resolve_isa",
    "sum_squares",
]
