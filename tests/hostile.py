"""Hostile torch files, built by the tests (no checked-in binaries): each writes `marker` when a
careless reader loads it. `live` proves a file is armed by loading it the careless way.

- "torchscript": a TorchScript archive whose module's __setstate__ creates `marker` with
  torch.from_file (torch.load without weights_only hands such a zip to torch.jit.load);
- "reduce zip": a torch.save zip whose pickle calls builtins.open(marker, "w") via __reduce__;
- "reduce legacy": the same object in torch's legacy (non-zip) format;
- "raw pickle": a bare pickle of it.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import torch

KINDS = ("torchscript", "reduce zip", "reduce legacy", "raw pickle")


class MarkerWriter(torch.nn.Module):
    """Scripted, its __setstate__ (run by torch.jit.load) writes b"pwned\\n" to `marker`."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker
        self.written = torch.zeros(0, dtype=torch.uint8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x

    @torch.jit.export
    def __getstate__(self) -> tuple[str, bool]:
        return (self.marker, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.marker = state[0]
        self.training = state[1]
        self.written = torch.from_file(self.marker, True, 6, dtype=torch.uint8)
        self.written.copy_(torch.tensor([112, 119, 110, 101, 100, 10], dtype=torch.uint8))


class OpensMarker:
    """Unpickled, it calls open(marker, "w"): the file appears."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def write(kind: str, path: Path, marker: Path) -> None:
    """Write the hostile file `kind` at `path`, armed to create `marker`."""
    payload = {"optimizer_state_dict": {"zero_stage": 3, "hook": OpensMarker(str(marker))},
               "param_shapes": [OpensMarker(str(marker))]}
    if kind == "torchscript":
        torch.jit.save(torch.jit.script(MarkerWriter(str(marker))), str(path))
    elif kind == "reduce zip":
        torch.save(payload, path)
    elif kind == "reduce legacy":
        torch.save(payload, path, _use_new_zipfile_serialization=False)
    elif kind == "raw pickle":
        path.write_bytes(pickle.dumps(payload, protocol=2))
    else:
        raise ValueError(kind)


def live(kind: str, path: Path, marker: Path) -> bool:
    """Whether loading `path` the careless way creates `marker` (removed again)."""
    if kind == "torchscript":
        torch.jit.load(str(path))
    elif kind == "raw pickle":
        pickle.loads(path.read_bytes())  # noqa: S301 (the point: it runs code)
    else:
        torch.load(path, weights_only=False)
    armed = marker.exists()
    if armed:
        os.remove(marker)
    return armed
