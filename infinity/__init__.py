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

# [Note: huge pages] A training step allocates and frees hundreds of MB of large tensors
# (autograd's weight gradients, activations), those above the mmap threshold the engine fixes
# (infinity/memory/malloc.py) each a fresh mapping, faulted in 4 KiB at a time. With
# THP_MEM_ALLOC_ENABLE=1 torch's CPU allocator asks for transparent huge pages
# (madvise(MADV_HUGEPAGE)) on tensors of 2 MiB and more: one fault per 2 MiB. Measured on the
# 294M GPT's NVMe step, int8 moments, no master: ~8% less wall and CPU time, the same peak RSS
# (docs/performance.md). torch reads the variable once, at its first CPU allocation (not at
# import), so it is set here unless the environment already says; where the kernel's THP mode
# is "never" it changes nothing.
if "THP_MEM_ALLOC_ENABLE" not in os.environ:
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"

from infinity import models, recompute  # noqa: E402 - after the wait policy and huge pages
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
