"""The tiered tensor store: every tensor by key on device, host or NVMe, under hard budgets."""

from infinity.store._common import Tier
from infinity.store._tiers import TierStats
from infinity.store.moves import DirectionStats, MoveLog
from infinity.store.tensor_store import TensorFuture, TensorStore

__all__ = ["DirectionStats", "MoveLog", "Tier", "TensorFuture", "TensorStore", "TierStats"]
