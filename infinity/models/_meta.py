"""Build a `transformers` model from its config with every parameter on the meta device (no
values anywhere), while buffers (rotary tables and the like, small) are computed for real."""

from __future__ import annotations

import os

import torch

from infinity.errors import CheckpointError
from infinity.paths import inside
from infinity.zero import parameters_on_meta


def build_on_meta(directory: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model that `directory/config.json` describes (its first `architectures` entry, else
    the AutoModelForCausalLM / AutoModel mapping), parameters on meta, in `dtype`."""
    import transformers  # heavy: only when a model is loaded

    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{config_path}: missing (a Hugging Face model directory needs its config.json)",
                              path=config_path)
    inside(directory, "config.json", source=directory)
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        architectures = getattr(config, "architectures", None) or []
        if not isinstance(architectures, list | tuple) or not all(
                isinstance(a, str) for a in architectures):
            raise ValueError(f"architectures must be a list of class names, got {architectures!r}")
        cls = getattr(transformers, architectures[0], None) if architectures else None
        with parameters_on_meta():
            if cls is not None:
                model = cls._from_config(config, dtype=dtype)
            else:
                try:
                    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
                except ValueError:
                    model = transformers.AutoModel.from_config(config, dtype=dtype)
    except Exception as exc:  # a handed-in config.json: transformers' checks raise many types
        why = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise CheckpointError(f"{config_path}: cannot build a model from it: {why}",
                              path=config_path) from None
    model.eval()
    return model
