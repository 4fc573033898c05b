"""Build a `transformers` model from its config with every parameter on the meta device (no
values anywhere), while buffers (rotary tables and the like, small) are computed for real."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from infinity.errors import CheckpointError


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within the block, each parameter a module registers moves to the meta device at once.

    Layers allocate their weight (untouched memory, never resident) and then initialise it;
    once moved, the initialisation runs on meta and costs nothing. Not thread-safe: it patches
    nn.Module.register_parameter for the duration (accelerate's init_empty_weights does the same).
    """
    original = torch.nn.Module.register_parameter

    def register(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = type(param)(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def build_on_meta(directory: str, dtype: torch.dtype) -> torch.nn.Module:
    """The model that `directory/config.json` describes (its first `architectures` entry, else
    the AutoModelForCausalLM / AutoModel mapping), parameters on meta, in `dtype`."""
    import transformers  # heavy: only when a model is loaded

    config_path = os.path.join(directory, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointError(f"{config_path}: missing (a Hugging Face model directory needs its config.json)",
                              path=config_path)
    try:
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{config_path}: cannot be read as a transformers config: {exc}",
                              path=config_path) from None
    architectures = getattr(config, "architectures", None) or []
    cls = getattr(transformers, architectures[0], None) if architectures else None
    with parameters_on_meta():
        if cls is not None:
            model = cls._from_config(config, dtype=dtype)
        else:
            try:
                model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
            except ValueError:
                model = transformers.AutoModel.from_config(config, dtype=dtype)
    model.eval()
    return model
