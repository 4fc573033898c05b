"""Loading a handed-in torch `.pt` file (DeepSpeed's) without running anything it asks for.

The file is checked as a zip first: a legacy (non-zip) pickle and a TorchScript archive are
refused (torch.load would unpickle the first with the caller's pickle module and hand the second
to torch.jit.load, which runs its code), every member is read once against the zip's own CRC-32
(torch never checks them: a flipped byte would load as a wrong value) and a compressed member is
refused (torch.save stores). The pickle is then loaded by torch's own weights-only unpickler
(`torch.load(weights_only=True)`), which builds tensors, containers and allow-listed globals
only. DeepSpeed pickles a few of its classes (`LossScaler`, `ZeroStageEnum`, `fragment_address`)
and DeepSpeed is not installed here: every `deepspeed.*` global the file names is allow-listed
as an inert stand-in (its pickled state kept as attributes; `ZeroStageEnum` becomes its number).
Any other global torch does not allow is refused with a line naming it and the file.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import torch

from infinity.errors import CheckpointError

_ZIP_MAGIC = b"PK\x03\x04"  # torch.load takes the zip path only for files that start with it
_CRC_BLOCK = 1 << 20


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
            self.__dict__.update({k: v for k, v in state.items() if isinstance(k, str)})
        else:
            self.state = state

    def __repr__(self) -> str:
        return f"<{type(self).__module__}.{type(self).__qualname__} {self.__dict__}>"


_STAND_INS: dict[str, Any] = {
    # An IntEnum pickles as a call of its class with its value: the stage number itself.
    "deepspeed.runtime.zero.config.ZeroStageEnum": int,
}


def _stand_in(path: str) -> Any:
    if path not in _STAND_INS:
        module, _, name = path.rpartition(".")
        _STAND_INS[path] = type(name, (DeepSpeedObject,), {"__module__": module})
    return _STAND_INS[path]


def _check_zip(path: Path) -> None:
    """CheckpointError unless `path` is a whole torch zip archive that is no TorchScript."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(_ZIP_MAGIC))
        if magic != _ZIP_MAGIC:
            raise CheckpointError(f"{path} is truncated or not a torch checkpoint file (no zip "
                                  f"archive; a legacy pickle is refused: it could run code)")
        with zipfile.ZipFile(path) as archive:
            infos = archive.infolist()
            names = [info.filename for info in infos]
            if len(set(names)) != len(names):
                raise CheckpointError(f"{path} is damaged: its zip archive names a member twice")
            if any(name.rpartition("/")[2] == "constants.pkl" for name in names):
                raise CheckpointError(f"{path} is a TorchScript archive, not a checkpoint: refused "
                                      f"(loading it would run its code)")
            for info in infos:
                if info.compress_type != zipfile.ZIP_STORED:
                    raise CheckpointError(f"{path}: member {info.filename} is compressed, which "
                                          f"torch.save never writes: refused")
                with archive.open(info) as member:  # raises BadZipFile at the end on a bad CRC
                    while member.read(_CRC_BLOCK):
                        pass
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, ValueError) as e:
        raise CheckpointError(f"{path} is truncated or damaged (its zip archive: {e})") from None


def _allowed_globals(path: Path) -> list[tuple[Any, str]]:
    """Stand-ins for the deepspeed.* globals the pickle names; CheckpointError naming any other
    global torch's weights-only unpickler does not allow."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception as e:  # a pickle torch cannot even scan: no checkpoint
        raise CheckpointError(f"{path} cannot be read as a checkpoint: {_reason(e)}") from None
    refused = sorted(g for g in unsafe if not g.startswith("deepspeed."))
    if refused:
        raise CheckpointError(f"{path} asks to load {refused[0]}, which a checkpoint reader does "
                              f"not run (not a DeepSpeed checkpoint file?)")
    return [(_stand_in(g), g) for g in unsafe]


def _reason(error: BaseException) -> str:
    """One line of what torch said (its weights-only messages span several lines)."""
    text = str(error)
    marker = "WeightsUnpickler error:"
    text = text.rpartition(marker)[2] if marker in text else text
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def load_pt(path: Path) -> Any:
    """The object a `.pt` file holds, its tensors memory-mapped (read on first touch), loaded as
    the module docstring says; CheckpointError naming the file otherwise."""
    if not path.is_file():
        raise CheckpointError(f"{path} is missing")
    _check_zip(path)
    allowed = _allowed_globals(path)
    try:
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # the weights-only unpickler on hostile bytes raises many types
        raise CheckpointError(f"{path} cannot be read (damaged, or not a checkpoint): "
                              f"{_reason(e)}") from None
