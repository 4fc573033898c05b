"""Infinity: fine-tune models larger than accelerator memory and RAM with tiered offload."""

import os
import sys

# [Note: threads that wait] torch's CPU kernels run on an OpenMP team (GNU libgomp here). By
# default a team thread that runs out of work spins for up to ~300,000 pauses before it sleeps,
# waiting for the next parallel region. On a quiet machine that saves a wake-up; on a busy one
# the spinning threads burn the cores the work needs (the engine's optimizer worker, the I/O
# threads, other processes), and a step of the default infinity-train run took 10x longer than
# with sleeping waits (interleaved A/B with the machine loaded, docs/performance.md). The wait
# policy is read once, when torch loads the OpenMP runtime: so it is chosen here, before the
# first torch import, unless the environment already says. Imported after torch, this cannot
# act; initialize() then says so when the machine is busy (infinity/engine/_threads.py).
if "OMP_WAIT_POLICY" not in os.environ and "torch" not in sys.modules:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

from infinity import models, recompute  # noqa: E402 - after the wait policy
from infinity.engine import Engine, initialize  # noqa: E402
from infinity.errors import (  # noqa: E402
    BudgetError,
    CheckpointError,
    ClosedError,
    ConfigError,
    ConfigPathError,
    NonFiniteGradientError,
    RankError,
)

__all__ = ["BudgetError", "CheckpointError", "ClosedError", "ConfigError", "ConfigPathError",
           "Engine", "NonFiniteGradientError", "RankError", "initialize", "models", "recompute"]
