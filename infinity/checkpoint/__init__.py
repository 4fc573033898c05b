"""Checkpoints: the Infinity format (atomic, verified, sliceable) and DeepSpeed checkpoints read
without DeepSpeed, converted to Hugging Face, safetensors, torch or zarr with bounded memory."""

from infinity.checkpoint._safetensors import write_safetensors
from infinity.checkpoint._shards import plan_shards, write_index
from infinity.checkpoint.async_writer import AsyncCheckpointWriter
from infinity.checkpoint.convert import FORMATS, Conversion, ConversionResult, ConvertedFile
from infinity.checkpoint.deepspeed import (
    DeepSpeedReader,
    find_deepspeed_tag,
    is_deepspeed_checkpoint,
)
from infinity.checkpoint.manifest import FORMAT_VERSION, Manifest, TensorEntry
from infinity.checkpoint.naming import ADAM_STATES, is_model_weight, optimizer_state_name
from infinity.checkpoint.reader import CheckpointReader, is_infinity_checkpoint, latest_tag
from infinity.checkpoint.rng import load_rng_state, rng_state, save_rng_state
from infinity.checkpoint.sources import TensorSource, open_source
from infinity.checkpoint.writer import CheckpointWriter, TensorSink, remove_debris

__all__ = [
    "ADAM_STATES",
    "FORMATS",
    "FORMAT_VERSION",
    "AsyncCheckpointWriter",
    "CheckpointReader",
    "CheckpointWriter",
    "Conversion",
    "ConversionResult",
    "ConvertedFile",
    "DeepSpeedReader",
    "Manifest",
    "TensorEntry",
    "TensorSink",
    "TensorSource",
    "find_deepspeed_tag",
    "is_deepspeed_checkpoint",
    "is_infinity_checkpoint",
    "is_model_weight",
    "latest_tag",
    "load_rng_state",
    "open_source",
    "optimizer_state_name",
    "plan_shards",
    "remove_debris",
    "rng_state",
    "save_rng_state",
    "write_index",
    "write_safetensors",
]
