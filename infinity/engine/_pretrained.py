"""`model.save_pretrained(dir)` for a transformers model whose parameters live in the engine's
store: the real values, streamed one unit at a time into safetensors shards, instead of the
empty placeholders the model's own method would find.

`initialize` replaces the method on the model instance (`attach_save_pretrained`); once the
engine is closed the model's own method runs again (its parameters hold their values again,
unless the engine was closed with `restore_params=False`). Every rank calls it (a ZeRO-3 unit
is gathered from the ranks); the main process alone writes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from infinity.checkpoint import plan_shards, write_index, write_safetensors
from infinity.config import parse_bytes
from infinity.engine._step_state import StepPhase

if TYPE_CHECKING:
    from infinity.engine._engine import Engine

INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD = "50GB"  # transformers' default


def attach_save_pretrained(engine: Engine) -> None:
    """Make `engine.module.save_pretrained` write the values from the store (transformers
    models only; a peft model's is refused clearly, its adapters are not exported this way)."""
    model = engine.module
    own = getattr(type(model), "save_pretrained", None)
    if own is None or not hasattr(model, "config"):
        return

    def save_pretrained(save_directory: str | os.PathLike[str], *args: Any, **kwargs: Any) -> None:
        if engine.phase is StepPhase.CLOSED:
            return own(model, save_directory, *args, **kwargs)
        return save_streamed(engine, save_directory, *args, **kwargs)

    save_pretrained.__doc__ = save_streamed.__doc__
    model.save_pretrained = save_pretrained


def save_streamed(
    engine: Engine,
    save_directory: str | os.PathLike[str],
    is_main_process: bool = True,
    state_dict: dict[str, torch.Tensor] | None = None,
    push_to_hub: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD,
    safe_serialization: bool = True,
    **ignored: Any,
) -> None:
    """transformers' `save_pretrained`, with the values streamed from the engine's store:
    config.json (+ generation_config.json) and safetensors shards of at most `max_shard_size`
    (`model.safetensors`, or `model-0000i-of-0000n.safetensors` + index), loadable with
    `from_pretrained`. Values in their stored dtype; a tied parameter once (its first name);
    persistent buffers as the model holds them. Every rank must call it (ZeRO-3 units are
    gathered); `is_main_process` alone writes."""
    model = engine.module
    if hasattr(model, "peft_config"):
        raise NotImplementedError(
            "save_pretrained of a peft model trained by the engine is not streamed: "
            "export with infinity.train.export.write_adapter, or close the engine first"
        )
    if state_dict is not None or push_to_hub or not safe_serialization:
        raise ValueError(
            "save_pretrained of a model in the engine's store writes its own values as "
            "safetensors: state_dict, push_to_hub and safe_serialization=False are not supported"
        )
    max_nbytes = max_shard_size if isinstance(max_shard_size, int) else parse_bytes(max_shard_size)
    tensors = _specs(engine)
    values = _values(engine)
    if not is_main_process:
        for _ in values:  # take part in every gather
            pass
        return
    directory = Path(save_directory)
    directory.mkdir(parents=True, exist_ok=True)
    _remove_old_weights(directory)
    model.config.dtype = _stored_dtype(engine)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(directory)
    if (
        getattr(model, "generation_config", None) is not None
        and getattr(model, "can_generate", bool)()
    ):
        model.generation_config.save_pretrained(directory)
    sizes = {name: shape.numel() * dtype.itemsize for name, shape, dtype in tensors}
    shards = plan_shards(sizes, max_nbytes, "model", ".safetensors")
    meta = {name: (name, tuple(shape), dtype) for name, shape, dtype in tensors}

    def pieces(name: str) -> Iterator[torch.Tensor]:
        got, tensor = next(values)
        if got != name:
            raise RuntimeError(
                f"save_pretrained: the store gave {got!r} where {name!r} was planned"
            )
        yield tensor.reshape(-1)

    for file, names in shards:
        write_safetensors(directory / file, [meta[n] for n in names], pieces)
    if len(shards) > 1:
        write_index(directory / INDEX_NAME, shards, sum(sizes.values()))


def _specs(engine: Engine) -> list[tuple[str, torch.Size, torch.dtype]]:
    params = [(s.name, s.shape, u.dtype) for u in engine.units for s in u.slots]
    return params + [(name, b.shape, b.dtype) for name, b in _buffers(engine.module).items()]


def _values(engine: Engine) -> Iterator[tuple[str, torch.Tensor]]:
    yield from engine.parameter_views()
    yield from _buffers(engine.module).items()


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The persistent buffers of `model` (what its state dict holds besides parameters)."""
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return {
        name: t.detach().cpu()
        for name, t in model.state_dict(keep_vars=True).items()
        if name not in params
    }


def _stored_dtype(engine: Engine) -> str:
    floating = [u.dtype for u in engine.units if u.dtype.is_floating_point]
    return str(floating[0] if floating else torch.float32).removeprefix("torch.")


def _remove_old_weights(directory: Path) -> None:
    """Weights of an earlier save in the same directory (another shard count) would mix in."""
    for path in [*directory.glob("model*.safetensors"), directory / INDEX_NAME]:
        if path.is_file():
            path.unlink()
