"""Models larger than RAM: a local Hugging Face checkpoint streamed into the store
(`load`); checkpoints written tensor by tensor (`write_shards`), e.g. a random model of any
size for benchmarks (`write_random_model`); see docs/scale.md."""

from infinity.models._load import DEFAULT_WINDOW, load
from infinity.models._random import BYTE_TOKENS, byte_tokenizer, write_random_model
from infinity.models._writer import plan_shards, write_shards

__all__ = ["BYTE_TOKENS", "DEFAULT_WINDOW", "byte_tokenizer", "load", "plan_shards", "write_random_model", "write_shards"]
