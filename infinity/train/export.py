"""Export a trained engine's model in Hugging Face format, streamed from the store unit by unit:
safetensors shards (`model-0000i-of-0000N.safetensors`) + `model.safetensors.index.json` +
`config.json` (+ generation config and tokenizer files when there are some).
`write_adapter` saves only a peft model's LoRA adapters, as peft's `save_pretrained` lays them
out (`adapter_model.safetensors` + `adapter_config.json`), for `PeftModel.from_pretrained`.

Shards are planned from the parameter specs before any value is read and written tensor by
tensor (`infinity.models.write_shards`), so at most one unit's values are held at a time. A
LoRA model (peft) is exported merged: W + scaling * B @ A per adapted layer, under the base
model's names, loadable without peft.
"""

from __future__ import annotations

import copy
import math
import pathlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from safetensors.torch import save_file

from infinity.engine import Engine, parameter_specs
from infinity.models import write_shards
from infinity.train import bars

PEFT_PREFIX = "base_model.model."
MAX_SHARD_BYTES = 2 << 30


def export_nbytes(model_dir: str | None, model: torch.nn.Module | None) -> int:
    """About what the export will write: the weight files of `model_dir` (--model: the export
    has its names and dtypes), else the built-in `model`'s tensors."""
    if model_dir is None:
        assert model is not None
        return sum(t.numel() * t.element_size() for t in model.state_dict().values())
    files = list(pathlib.Path(model_dir).iterdir())
    weights = [f for f in files if f.suffix == ".safetensors"] or \
        [f for f in files if f.suffix == ".bin"]  # a folder may ship both: the same weights
    return sum(f.stat().st_size for f in weights)


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def _base_name(name: str) -> str:
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def _lora_scalings(model: torch.nn.Module) -> dict[str, float]:
    """peft layer name -> scaling of its "default" adapter."""
    return {name: float(m.scaling["default"]) for name, m in model.named_modules()
            if isinstance(getattr(m, "scaling", None), dict) and "default" in m.scaling}


def is_peft(model: torch.nn.Module) -> bool:
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def exported_tensors(engine: Engine, *, merge: bool = True
                     ) -> tuple[list[tuple[str, torch.Size, torch.dtype]],
                                Callable[[], Iterator[tuple[str, torch.Tensor]]]]:
    """(specs in export order, a function streaming (name, tensor) in that order), merging LoRA
    adapters into their base weights for a peft model (without `merge`: the base model alone);
    persistent buffers come last."""
    model = engine.module
    buffers = _persistent_buffers(model)
    if not is_peft(model):
        specs = [(s.name, s.shape, s.dtype) for s in parameter_specs(engine)]
        return specs + _buffer_specs(buffers), lambda: _chain(engine.named_parameters(), buffers)
    specs = [(_base_name(s.name), s.shape, s.dtype) for s in parameter_specs(engine)
             if not _is_adapter(s.name)]
    scalings = _lora_scalings(model)
    if not merge:
        def base() -> Iterator[tuple[str, torch.Tensor]]:
            for name, values in engine.named_parameters(lambda n: not _is_adapter(n)):
                yield _base_name(name), values
            yield from buffers.items()
        return specs + _buffer_specs(buffers), base

    def merged() -> Iterator[tuple[str, torch.Tensor]]:
        adapters = dict(engine.named_parameters(_is_adapter))  # small: rank x width per layer
        for name, values in engine.named_parameters(lambda n: not _is_adapter(n)):
            stem = name.removesuffix(".base_layer.weight")
            if stem != name:
                a = adapters[f"{stem}.lora_A.default.weight"].float()
                b = adapters[f"{stem}.lora_B.default.weight"].float()
                values = (values.float() + scalings[stem] * (b @ a)).to(values.dtype)
            yield _base_name(name), values
        yield from buffers.items()
    return specs + _buffer_specs(buffers), merged


def _persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    state = model.state_dict(keep_vars=True)
    return {_base_name(n): t.detach().cpu() for n, t in state.items() if n not in params}


def _buffer_specs(buffers: dict[str, torch.Tensor]) -> list[tuple[str, torch.Size, torch.dtype]]:
    return [(n, t.shape, t.dtype) for n, t in buffers.items()]


def _chain(params: Iterator[tuple[str, torch.Tensor]], buffers: dict[str, torch.Tensor]):
    yield from params
    yield from buffers.items()


def _with_progress(tensors: Iterator[tuple[str, torch.Tensor]], total: int, shown: bool
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream, with a bar of the bytes exported (on stderr, after a second)."""
    with bars.bar(total=total, desc="exporting", unit="B", unit_scale=True, shown=shown) as bar:
        for name, values in tensors:
            bar.update(values.numel() * values.element_size())
            yield name, values


def write_hf(engine: Engine, directory: str | pathlib.Path, *, tokenizer: Any = None,
             max_shard_bytes: int = MAX_SHARD_BYTES, merge: bool = True,
             progress: bool = False) -> list[pathlib.Path]:
    """Write the engine's current model into `directory` (created); returns the files written.
    A peft model is exported merged, or with `merge` False its base model alone."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    specs, stream = exported_tensors(engine, merge=merge)
    total = sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in specs)
    files = write_shards(directory, specs, _with_progress(stream(), total, progress),
                         max_shard_bytes=max_shard_bytes)
    files += _write_config(engine.module, directory, specs)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
    return files


def _write_config(model: torch.nn.Module, directory: pathlib.Path,
                  specs: list[tuple[str, torch.Size, torch.dtype]]) -> list[pathlib.Path]:
    base = model.get_base_model() if is_peft(model) else model
    written = []
    if getattr(base, "config", None) is not None:
        config = copy.deepcopy(base.config)
        floats = [dtype for _, _, dtype in specs if dtype.is_floating_point]
        if floats:
            config.dtype = max(set(floats), key=floats.count)  # what the shards hold
        config.save_pretrained(directory)
        written.append(directory / "config.json")
    generation = getattr(base, "generation_config", None)
    if generation is not None:
        generation.save_pretrained(directory)
        written.append(directory / "generation_config.json")
    return written


def write_adapter(engine: Engine, directory: str | pathlib.Path, *, tokenizer: Any = None,
                  base: str | None = None) -> list[pathlib.Path]:
    """Write the LoRA adapters of the engine's peft model into `directory` (created), named as
    peft saves them (the adapter name "default" dropped from the keys); `base`, when given, is
    the adapter config's base_model_name_or_path."""
    model = engine.module
    if not is_peft(model):
        raise ValueError("write_adapter needs a peft model (train with --lora)")
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name.replace(".default.", "."): values.contiguous()
               for name, values in engine.named_parameters(_is_adapter)}
    path = directory / "adapter_model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    adapter_config = copy.copy(model.peft_config["default"])
    if base is not None:
        adapter_config.base_model_name_or_path = base
    adapter_config.save_pretrained(directory)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(directory)
    return [path, directory / "adapter_config.json"]
