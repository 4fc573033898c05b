"""Random number generator states in a checkpoint, so a resumed run draws what the uninterrupted
one would have (dropout masks, data shuffles, sampling).

torch's states (CPU, and every CUDA device) are uint8 tensors stored as "rng/torch" and
"rng/cuda<i>"; numpy's legacy global generator and Python's `random` go into the manifest's
metadata under "rng" as JSON.
"""

from __future__ import annotations

import logging
import random

import numpy as np
import torch

from infinity.checkpoint.async_writer import AsyncCheckpointWriter
from infinity.checkpoint.reader import CheckpointReader
from infinity.checkpoint.writer import CheckpointWriter
from infinity.errors import CheckpointError

logger = logging.getLogger(__name__)

TORCH_KEY = "rng/torch"


def _cuda_key(index: int) -> str:
    return f"rng/cuda{index}"


def save_rng_state(writer: CheckpointWriter | AsyncCheckpointWriter) -> None:
    """Add this process's RNG states to the checkpoint `writer` is writing."""
    writer.add(TORCH_KEY, torch.get_rng_state())
    if torch.cuda.is_available():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            writer.add(_cuda_key(index), state)
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    version, internal, gauss = random.getstate()
    writer.metadata["rng"] = {"numpy": [name, keys.tolist(), pos, has_gauss, cached],
                              "python": [version, list(internal), gauss]}


def load_rng_state(reader: CheckpointReader) -> None:
    """Set this process's RNG states from the checkpoint; CheckpointError when it holds none.
    CUDA states are restored when the checkpoint and this process see the same device count
    (else logged and left as they are: another machine's devices)."""
    saved = reader.metadata.get("rng")
    if saved is None or TORCH_KEY not in reader.names():
        raise CheckpointError(f"checkpoint {reader.path} holds no RNG state")
    torch.set_rng_state(reader.read(TORCH_KEY))
    cuda = [name for name in reader.names() if name.startswith("rng/cuda")]
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([reader.read(_cuda_key(i)) for i in range(len(cuda))])
    elif cuda or torch.cuda.is_available():
        logger.warning("checkpoint %s has %d CUDA RNG states, this process sees %d devices: CUDA "
                       "RNG states not restored", reader.path, len(cuda),
                       torch.cuda.device_count() if torch.cuda.is_available() else 0)
    name, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss = saved["python"]
    random.setstate((version, tuple(internal), gauss))
