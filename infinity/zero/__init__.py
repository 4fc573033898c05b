"""ZeRO-3 in one process: parameters live in the store as per-module fetch units and come in
along the layer trace (see DESIGN.md, "zero")."""

from infinity.zero._common import PrefetchStats, UnitState
from infinity.zero.coordinator import ParamCoordinator
from infinity.zero.grads import GradBuffer, RamGrad, StoredGrad
from infinity.zero.hooks import ModelHooks
from infinity.zero.trace import Trace, TraceBook
from infinity.zero.unit import FetchUnit, ParamSlot, place_units, plan_units

__all__ = ["FetchUnit", "GradBuffer", "ModelHooks", "ParamCoordinator", "ParamSlot", "PrefetchStats",
           "RamGrad", "StoredGrad", "Trace", "TraceBook", "UnitState", "place_units", "plan_units"]
