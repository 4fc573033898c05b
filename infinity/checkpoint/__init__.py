"""Checkpoints: the Infinity format (atomic, verified, sliceable) and DeepSpeed checkpoints read
without DeepSpeed, converted to Hugging Face, safetensors, torch or zarr with bounded memory."""

from infinity.checkpoint.manifest import FORMAT_VERSION, Manifest, TensorEntry
from infinity.checkpoint.reader import CheckpointReader, is_infinity_checkpoint, latest_tag
from infinity.checkpoint.writer import CheckpointWriter, TensorSink, remove_debris

__all__ = [
    "FORMAT_VERSION",
    "CheckpointReader",
    "CheckpointWriter",
    "Manifest",
    "TensorEntry",
    "TensorSink",
    "is_infinity_checkpoint",
    "latest_tag",
    "remove_debris",
]
