"""Optimizers that run where the state is: CPU Adam / AdamW over host (and swapped) tensors."""

from infinity.optim._native import adam_step, available_isas, resolve_isa
from infinity.optim.cpu_adam import CPUAdam
from infinity.optim.loss_scaler import DynamicLossScaler
from infinity.optim.swapped import StepResult, SwappedOptimizer, UnitSpec

__all__ = [
    "CPUAdam",
    "DynamicLossScaler",
    "StepResult",
    "SwappedOptimizer",
    "UnitSpec",
    "adam_step",
    "available_isas",
    "resolve_isa",
]
