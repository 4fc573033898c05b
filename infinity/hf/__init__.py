"""Hugging Face faces over Infinity: `Trainer` (transformers' Trainer training through the
engine, with `config=` a DeepSpeed JSON) and `from_pretrained` (a model streamed into the store).
See docs/hf.md."""

from infinity.hf._config import fill_from_training_args
from infinity.hf._pretrained import from_pretrained
from infinity.hf._trainer import Trainer

__all__ = ["Trainer", "fill_from_training_args", "from_pretrained"]
