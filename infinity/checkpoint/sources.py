"""What a converter reads from: an Infinity checkpoint or a DeepSpeed one, behind one face."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from infinity.checkpoint._common import ProgressCallback
from infinity.checkpoint.deepspeed import DeepSpeedReader, is_deepspeed_checkpoint
from infinity.checkpoint.reader import CheckpointReader, is_infinity_checkpoint, latest_tag
from infinity.errors import CheckpointError


class TensorSource(Protocol):
    """Named tensors read piece by piece (CheckpointReader and DeepSpeedReader are ones)."""

    path: Path

    @property
    def metadata(self) -> dict[str, Any]: ...

    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def dtype(self, name: str) -> torch.dtype: ...

    def iter_chunks(self, name: str, on_progress: ProgressCallback | None = None) -> Iterator[torch.Tensor]: ...


def open_source(path: str | Path, tag: str | None = None) -> TensorSource:
    """The checkpoint at `path` (a run directory with `latest`, or a tag directory), Infinity or
    DeepSpeed; CheckpointError when it is neither."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory, so not a checkpoint")
    if (tag is None and is_infinity_checkpoint(path)) or (tag is not None and (path / tag / "manifest.json").is_file()):
        return CheckpointReader(path, tag)
    if tag is not None or is_deepspeed_checkpoint(path):
        return DeepSpeedReader(path, tag)
    latest_tag(path)  # a `latest` naming no tag inside `path`: the error says so
    raise CheckpointError(f"{path} is neither an Infinity checkpoint (no manifest.json, no "
                          f"'latest' naming one) nor a DeepSpeed one (no *_model_states.pt)")
