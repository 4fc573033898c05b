"""The model of a run: the built-in default (a small Llama from the shipped config, byte tokens),
or a local Hugging Face directory with its tokenizer; optionally wrapped with LoRA adapters."""

from __future__ import annotations

import contextlib
import json
import logging
import pathlib
from collections.abc import Iterator
from importlib import resources
from typing import Any

import torch

from infinity.errors import CheckpointError, InputError
from infinity.models import (
    BYTE_VOCAB_SIZE,
    DEFAULT_WINDOW,
    byte_config_ids,
    byte_tokenizer,
    load,
)
from infinity.train import bars

logger = logging.getLogger(__name__)

DEFAULTS = resources.files("infinity.train") / "default"
# peft: every Linear but the output head (attention and MLP projections)
LORA_TARGETS = "all-linear"


def default_model(seed: int = 0) -> tuple[torch.nn.Module, Any]:
    """A freshly initialised Llama of the shape in `default/model_config.json` (seeded) and its
    tokenizer, `infinity.models.byte_tokenizer()` (exported with the model), whose vocabulary
    and special ids the config takes."""
    import transformers

    fields = json.loads((DEFAULTS / "model_config.json").read_text())
    config = transformers.LlamaConfig(**{k: v for k, v in fields.items()
                                         if k not in ("architectures", "model_type")},
                                      vocab_size=BYTE_VOCAB_SIZE, **byte_config_ids())
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config), byte_tokenizer()


def load_model(directory: str | pathlib.Path, config: dict[str, Any], *, lora: int | None = None,
               window: int = DEFAULT_WINDOW, progress: bool = False) -> torch.nn.Module:
    """A causal LM from a local Hugging Face directory, streamed into the engine's store with
    `infinity.models.load` (never whole in RAM; initialize it with the same `config`), with
    LoRA adapters of rank `lora` added before it is placed (the frozen base gets no optimizer
    state); `progress` shows a bar of the bytes loaded. InputError when the directory is not a
    loadable model."""
    directory = _model_dir(directory)
    prepare = None if lora is None else lambda model: add_lora(model, lora)
    try:
        with bars.bar(desc="loading", unit="B", unit_scale=True, shown=progress) as bar, \
                _config_notes_muted():
            return load(directory, config, window=window, prepare=prepare, progress=bar.update)
    except CheckpointError as e:
        raise InputError(f"--model {directory}: cannot load a causal LM "
                         f"({_first_line(e)})") from None


@contextlib.contextmanager
def _config_notes_muted() -> Iterator[None]:
    """Without the config loader's notes: `load` reads the config twice on its way, and
    `initialize` says the same once more."""
    config_logger = logging.getLogger("infinity.config")
    level = config_logger.level
    config_logger.setLevel(max(logging.WARNING, config_logger.getEffectiveLevel()))
    try:
        yield
    finally:
        config_logger.setLevel(level)


def load_tokenizer(directory: str | pathlib.Path) -> Any:
    """The directory's own tokenizer (local files only); InputError when it has none."""
    import transformers

    directory = _model_dir(directory)
    try:
        return transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except Exception as e:  # transformers on a handed-in directory raises many types
        raise InputError(f"--model {directory}: no usable tokenizer ({_first_line(e)})") from None


def max_positions(model: torch.nn.Module) -> int | None:
    """The longest sequence the model's position embeddings cover, when its config says."""
    config = getattr(model, "config", None)
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def config_positions(directory: str) -> int | None:
    """max_position_embeddings (or n_positions) of --model's config.json, when it says."""
    try:
        fields = json.loads((pathlib.Path(directory) / "config.json").read_bytes())
    except (OSError, ValueError, RecursionError):
        return None  # load_model / load_tokenizer say what is wrong
    if not isinstance(fields, dict):
        return None
    found = (fields.get(k) for k in ("max_position_embeddings", "n_positions"))
    return next((n for n in found if isinstance(n, int) and not isinstance(n, bool) and n > 0),
                None)


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute activations in backward (transformers' gradient checkpointing, non-reentrant:
    it needs no input that requires grad, so a frozen LoRA base works too)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(base, "supports_gradient_checkpointing", False):
        raise InputError(f"--gradient-checkpointing: {type(base).__name__} does not support it")
    kwargs = {"use_reentrant": False}
    if hasattr(base, "activation_checkpointing_enable"):  # transformers 5's name for it
        base.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def add_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """Freeze `model` and add LoRA adapters of `rank` (alpha = 2 * rank, no dropout) on its
    attention and MLP projections; only the adapters train. On a model built on the meta
    device the adapters still get real values (peft's initialisation: A random, B zero)."""
    if rank < 1:
        raise InputError(f"--lora {rank}: the rank must be at least 1")
    try:
        import peft
    except ImportError:
        raise InputError("--lora needs the peft package: pip install 'peft>=0.10'") from None
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.0,
                             target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    wrapped = peft.get_peft_model(model, config)
    _materialise_adapters(wrapped)
    trained = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    logger.info("lora: rank %d, %d of %d parameters train", rank, trained, total)
    return wrapped


def _materialise_adapters(model: torch.nn.Module) -> None:
    """peft puts adapters on the device of their base layer, meta for a model being streamed
    in: give them memory and peft's initial values."""
    for module in model.modules():
        adapters = [getattr(module, name, None) for name in ("lora_A", "lora_B")]
        if hasattr(module, "reset_lora_parameters") and any(
                p.device.type == "meta" for a in adapters if a is not None for p in a.parameters()):
            for a in adapters:
                a.to_empty(device="cpu")
            module.reset_lora_parameters("default", True)


def _model_dir(directory: str | pathlib.Path) -> pathlib.Path:
    path = pathlib.Path(directory)
    if not path.is_dir():
        raise InputError(f"--model {path}: no such directory")
    if not (path / "config.json").is_file():
        raise InputError(f"--model {path}: no config.json (not a Hugging Face model directory)")
    return path


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
