"""Models larger than RAM: a local Hugging Face checkpoint streamed into the store
(`load`), or built from its config with no values anywhere (`build_on_meta`); checkpoints
written tensor by tensor (`write_shards`), e.g. a random model of any size for benchmarks
(`write_random_model`) with the byte-level tokenizer (`byte_tokenizer`, its ids named
`BYTE_*`); see docs/scale.md."""

from infinity.models._byte_tokenizer import (
    BYTE_BOS_ID,
    BYTE_EOS_ID,
    BYTE_PAD_ID,
    BYTE_TOKENS,
    BYTE_VOCAB_SIZE,
    byte_config_ids,
    byte_tokenizer,
)
from infinity.models._load import DEFAULT_WINDOW, load
from infinity.models._meta import build_on_meta
from infinity.models._random import write_random_model
from infinity.models._safetensors import INDEX_FILE
from infinity.models._writer import plan_shards, write_shards

__all__ = ["BYTE_BOS_ID", "BYTE_EOS_ID", "BYTE_PAD_ID", "BYTE_TOKENS", "BYTE_VOCAB_SIZE",
           "DEFAULT_WINDOW", "INDEX_FILE", "build_on_meta", "byte_config_ids", "byte_tokenizer",
           "load", "plan_shards", "write_random_model", "write_shards"]
