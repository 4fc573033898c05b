"""ZeRO: parameters live in the store as per-module fetch units and come in along the layer
trace, partitioned over data-parallel ranks by the stage (see docs/design.md and docs/engine.md)."""

from infinity.zero._common import PrefetchStats, UnitState
from infinity.zero.coordinator import ParamCoordinator
from infinity.zero.grads import FlatGrad, GradBuffer, HeldGrad, RamGrad, StoredGrad
from infinity.zero.hooks import ModelHooks
from infinity.zero.init import Init, buffers_to, create_units, is_deferred, parameters_on_meta
from infinity.zero.ranks import Partition, Ranks, Shard, environment_world_size
from infinity.zero.trace import Trace, TraceBook
from infinity.zero.unit import FetchUnit, ParamSlot, place_units, plan_units

__all__ = ["FetchUnit", "FlatGrad", "GradBuffer", "HeldGrad", "Init", "ModelHooks", "ParamCoordinator", "ParamSlot",
           "Partition", "PrefetchStats", "RamGrad", "Ranks", "Shard", "StoredGrad", "Trace", "TraceBook", "UnitState",
           "buffers_to", "create_units", "environment_world_size", "is_deferred", "parameters_on_meta",
           "place_units", "plan_units"]
