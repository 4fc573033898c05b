"""Random number generator states in a checkpoint, so a resumed run draws what the uninterrupted
one would have (dropout masks, data shuffles, sampling).

torch's states (CPU, and every CUDA device) are uint8 tensors stored as "rng/torch" and
"rng/cuda<i>"; numpy's legacy global generator and Python's `random` go into the manifest's
metadata under "rng" as JSON. With data-parallel ranks, rank r > 0's are "rng/rank<r>/torch",
"rng/rank<r>/cuda<i>" and metadata "rng_rank<r>" (rank 0's keep the one-process names).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from infinity.checkpoint.async_writer import AsyncCheckpointWriter
from infinity.checkpoint.reader import CheckpointReader
from infinity.checkpoint.writer import CheckpointWriter
from infinity.errors import CheckpointError

logger = logging.getLogger(__name__)


def _prefix(rank: int) -> str:
    """Rank 0's states keep the one-process names; data-parallel rank r > 0 adds "rank<r>/"."""
    return "rng/" if rank == 0 else f"rng/rank{rank}/"


def _cuda_key(index: int, rank: int = 0) -> str:
    return f"{_prefix(rank)}cuda{index}"


def _metadata_key(rank: int) -> str:
    return "rng" if rank == 0 else f"rng_rank{rank}"


def rng_state() -> dict[str, Any]:
    """This process's RNG states: torch's (CPU, each CUDA device) as uint8 tensors, numpy's
    legacy global generator and Python's `random` as JSON."""
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    version, internal, gauss = random.getstate()
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "json": {"numpy": [name, keys.tolist(), pos, has_gauss, cached],
                     "python": [version, list(internal), gauss]}}


def save_rng_state(writer: CheckpointWriter | AsyncCheckpointWriter,
                   state: dict[str, Any] | None = None, *, rank: int = 0) -> None:
    """Add RNG states (default: this process's) to the checkpoint `writer` is writing, as those
    of data-parallel rank `rank`."""
    state = rng_state() if state is None else state
    writer.add(f"{_prefix(rank)}torch", state["torch"])
    for index, cuda in enumerate(state["cuda"]):
        writer.add(_cuda_key(index, rank), cuda)
    writer.metadata[_metadata_key(rank)] = state["json"]


def load_rng_state(reader: CheckpointReader, *, rank: int = 0) -> None:
    """Set this process's RNG states from the checkpoint: those saved by data-parallel rank
    `rank`, or rank 0's when it had fewer ranks (logged); CheckpointError when it holds none.
    CUDA states are restored when the checkpoint and this process see the same device count
    (else logged and left as they are: another machine's devices)."""
    names = set(reader.names())
    if rank and f"{_prefix(rank)}torch" not in names:
        logger.warning("checkpoint %s holds no RNG state of rank %d "
                       "(it was written by fewer ranks): rank %d starts from rank 0's",
                       reader.path, rank, rank)
        rank = 0
    saved = reader.metadata.get(_metadata_key(rank))
    if saved is None or f"{_prefix(rank)}torch" not in names:
        raise CheckpointError(f"checkpoint {reader.path} holds no RNG state")
    torch.set_rng_state(reader.read(f"{_prefix(rank)}torch"))
    cuda = [name for name in names if name.startswith(f"{_prefix(rank)}cuda")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([reader.read(_cuda_key(i, rank)) for i in range(len(cuda))])
    elif cuda or torch.cuda.is_available():
        logger.warning("checkpoint %s has %d CUDA RNG states, this process sees %d devices: CUDA "
                       "RNG states not restored", reader.path, len(cuda),
                       torch.cuda.device_count() if torch.cuda.is_available() else 0)
    name, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = saved["python"]
    random.setstate((version, tuple(internal), gauss))
