"""Loading DeepSpeed's .pt files without DeepSpeed installed and without running their code.

DeepSpeed's optimizer files pickle a few of its classes (`LossScaler`, `ZeroStageEnum`,
`fragment_address`), so a plain `torch.load` needs DeepSpeed, and `weights_only=False` would run
whatever a handed-in file asks for. The unpickler here resolves only a fixed list of harmless
globals; every `deepspeed.*` global becomes an inert stand-in that keeps its state as attributes,
and anything else is refused with an error naming the global and the file.
"""

from __future__ import annotations

import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from infinity.errors import CheckpointError

# (module, name) a DeepSpeed checkpoint may reference besides deepspeed.* and torch's storages.
_SAFE_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch", "Size"),
    ("torch", "device"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "slice"),
    ("builtins", "complex"),
    ("_codecs", "encode"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
}
_TORCH_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}


class DeepSpeedObject:
    """An instance of a DeepSpeed class, rebuilt inertly: its pickled state as attributes and
    its constructor arguments in `args`. The class name says what it stood for."""

    def __new__(cls, *args: Any, **kwargs: Any) -> DeepSpeedObject:
        obj = super().__new__(cls)
        obj.args = args
        return obj

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots) of a __slots__ class
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.{type(self).__qualname__} {self.__dict__}>"


_STAND_INS: dict[tuple[str, str], Any] = {
    # An IntEnum pickles as a call of its class with its value: the stage number itself.
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): int,
}


def _stand_in(module: str, name: str) -> Any:
    if (module, name) not in _STAND_INS:
        _STAND_INS[module, name] = type(name, (DeepSpeedObject,), {"__module__": module})
    return _STAND_INS[module, name]


class _RestrictedUnpickler(pickle.Unpickler):
    path = "?"  # set per load by RestrictedPickle.for_file

    def find_class(self, module: str, name: str) -> Any:
        if module == "deepspeed" or module.startswith("deepspeed."):
            return _stand_in(module, name)
        if (module, name) in _SAFE_GLOBALS or (module == "torch" and name in _TORCH_DTYPES):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.path} asks to load {module}.{name}, which a checkpoint "
                              f"reader does not run (not a DeepSpeed checkpoint file?)")


class _RestrictedPickle:
    """A `pickle_module` for torch.load whose Unpickler is the restricted one."""

    __name__ = "infinity_restricted_pickle"  # torch.load asks (it special-cases dill)

    def __init__(self, path: Path) -> None:
        self.Unpickler = type("Unpickler", (_RestrictedUnpickler,), {"path": str(path)})


def load_pt(path: Path) -> Any:
    """torch.load of `path` (memory-mapped: tensors are read on first touch) through the
    restricted unpickler; CheckpointError naming the file when it is missing, truncated or no
    torch file."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    if not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is truncated or not a torch checkpoint file (no zip archive)")
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=False,
                          pickle_module=_RestrictedPickle(path))
    except CheckpointError:
        raise
    except (RuntimeError, OSError, pickle.UnpicklingError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read (truncated or damaged?): {e}") from e
