"""Dtypes as checkpoints name them, and the progress-callback type shared by the modules."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from infinity.errors import CheckpointError

# Called with a count of bytes done since the last call (tools wrap it in a tqdm bar).
ProgressCallback = Callable[[int], None]

# logical dtype name -> (torch dtype, numpy dtype the bytes are stored as). zarr and numpy have
# no bfloat16: its bits are stored as uint16 and the manifest keeps the logical name.
DTYPES: dict[str, tuple[torch.dtype, np.dtype]] = {
    "float64": (torch.float64, np.dtype("<f8")),
    "float32": (torch.float32, np.dtype("<f4")),
    "float16": (torch.float16, np.dtype("<f2")),
    "bfloat16": (torch.bfloat16, np.dtype("<u2")),
    "int64": (torch.int64, np.dtype("<i8")),
    "int32": (torch.int32, np.dtype("<i4")),
    "int16": (torch.int16, np.dtype("<i2")),
    "int8": (torch.int8, np.dtype("i1")),
    "uint8": (torch.uint8, np.dtype("u1")),
    "bool": (torch.bool, np.dtype("?")),
}
_NAMES = {torch_dtype: name for name, (torch_dtype, _) in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16"; CheckpointError for a dtype checkpoints cannot hold."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise CheckpointError(f"dtype {dtype} cannot be stored in a checkpoint; supported: "
                              f"{sorted(DTYPES)}") from None


def torch_dtype(name: str) -> torch.dtype:
    """"bfloat16" -> torch.bfloat16; CheckpointError naming the unknown name."""
    try:
        return DTYPES[name][0]
    except KeyError:
        raise CheckpointError(f"unknown dtype {name!r}; known: {sorted(DTYPES)}") from None


def storage_dtype(name: str) -> np.dtype:
    """The numpy dtype whose bytes hold the logical dtype `name` (uint16 for bfloat16)."""
    torch_dtype(name)  # validates the name
    return DTYPES[name][1]


def to_storage(tensor: torch.Tensor) -> np.ndarray:
    """A CPU, contiguous numpy view of `tensor`'s bytes in its storage dtype (no copy when the
    tensor already is CPU and contiguous)."""
    tensor = tensor.detach().to("cpu").contiguous()
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.uint16)
    return tensor.numpy()


def from_storage(array: np.ndarray, name: str) -> torch.Tensor:
    """The tensor of logical dtype `name` over `array`'s bytes (shares memory)."""
    tensor = torch.from_numpy(np.ascontiguousarray(array))
    return tensor.view(torch.bfloat16) if name == "bfloat16" else tensor
