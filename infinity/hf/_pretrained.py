"""`infinity.hf.from_pretrained`: a Hugging Face model straight into the engine's store, from a
local folder or a hub id already in huggingface_hub's cache (offline: nothing is downloaded)."""

from __future__ import annotations

import os
from typing import Any

import torch

from infinity import models
from infinity.errors import CheckpointError


def from_pretrained(
    name_or_path: str | os.PathLike[str],
    config: dict[str, Any] | str | os.PathLike[str],
    **kwargs: Any,
) -> torch.nn.Module:
    """The model of `name_or_path` (a local folder of safetensors weights, or a hub id found in
    huggingface_hub's cache), its values streamed into the store laid out for `config`, ready
    for `infinity.hf.Trainer(model=..., config=config)` (the same config: "auto" precision
    resolves to fp32 here, as the Trainer's default arguments do). `revision=` picks a cached
    revision; the other keywords go to `infinity.models.load` (`window=`, `prepare=`).
    Raises CheckpointError, one line, for an id that is neither a folder nor cached."""
    revision = kwargs.pop("revision", None)
    path = os.fspath(name_or_path)
    if not os.path.isdir(path):
        path = _cached(path, revision)
    return models.load(path, config, **kwargs)


def _cached(repo_id: str, revision: str | None) -> str:
    try:
        import huggingface_hub
        from huggingface_hub import constants
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:
        raise CheckpointError(
            f"{repo_id}: not a local folder (and huggingface_hub, which would look for it in "
            "its cache, is not installed)",
            path=repo_id,
        ) from None
    try:
        return huggingface_hub.snapshot_download(repo_id, revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):
        raise CheckpointError(
            f"{repo_id}: neither a local folder nor in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); Infinity reads offline: download it "
            f"first (hf download {repo_id})",
            path=repo_id,
        ) from None
