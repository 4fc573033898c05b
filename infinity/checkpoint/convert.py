"""Converting a checkpoint (Infinity or DeepSpeed) to Hugging Face, safetensors, torch, zarr or
Infinity format, tensor by tensor, then checking the output against the source.

    conversion = Conversion("run/", to="hf", dtype=torch.bfloat16, max_shard_nbytes=5 << 30)
    result = conversion.run("out/", on_progress=bar.update)   # bar total: conversion.total_nbytes

Memory: safetensors/hf, zarr and infinity outputs stream piece by piece (one source chunk or
rank share at a time); torch shards are built in memory, so their peak is about one shard plus
one tensor. The output is written under a temporary name next to `destination` and renamed at
the end: a failure leaves no partial output. Model formats (hf, safetensors, torch) hold the
model weights only; zarr and infinity keep optimizer states too ("exp_avg/<name>").
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import zarr

import aio
from infinity.checkpoint._common import (
    ProgressCallback,
    dtype_name,
    from_storage,
    storage_dtype,
    to_storage,
    torch_dtype,
)
from infinity.checkpoint._durable import TEMPORARY_PREFIX, fsync_tree, replace_durably
from infinity.checkpoint._safetensors import read_safetensors, write_safetensors
from infinity.checkpoint._shards import plan_shards, write_index
from infinity.checkpoint.naming import is_model_weight
from infinity.checkpoint.reader import CheckpointReader
from infinity.checkpoint.sources import TensorSource, open_source
from infinity.checkpoint.writer import (
    DEFAULT_CHUNK_NBYTES,
    CheckpointWriter,
    TensorSink,
    array_options,
    tensor_entry,
)
from infinity.errors import CheckpointError
from infinity.paths import naming

logger = logging.getLogger(__name__)

FORMATS = ("hf", "safetensors", "torch", "zarr", "infinity")
_MODEL_FILES = ("config.json", "generation_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "added_tokens.json", "tokenizer.model", "vocab.json", "merges.txt",
                    "chat_template.jinja")
RUN_CHECKPOINTS = "checkpoints"  # infinity-train's --output holds its checkpoints here


def _run_checkpoints(source: Path, tag: str | None) -> Path:
    """An infinity-train output folder stands for its checkpoints (`checkpoints/latest`)."""
    inner = source / RUN_CHECKPOINTS
    if tag is None and not (source / "latest").is_file() and (inner / "latest").is_file():
        return inner
    return source


def _tokenizer_dir(*places: Path | None) -> Path | None:
    """The first of `places` holding tokenizer files (a model directory, the run folder)."""
    return next((p for p in places if p is not None and (p / "tokenizer_config.json").is_file()),
                None)


def _read_configs(directory: Path) -> dict[str, dict[str, Any]]:
    """The model's JSON files in `directory`; CheckpointError naming one that is no JSON object."""
    found = {}
    for name in _MODEL_FILES:
        path = directory / name
        if not path.is_file():
            continue
        try:
            found[name] = json.loads(path.read_bytes())
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise CheckpointError(f"{path} is not JSON: {e}") from None
        if not isinstance(found[name], dict):
            raise CheckpointError(f"{path} is not a JSON object")
    return found


def _check_zarr_names(names: list[str], source: Path) -> None:
    """Tensor names are zarr node paths in a zarr output: '/'-separated, no empty, '.', '..' or
    '__' part (which would lead out of the output directory or be zarr's), and no name the
    group of another ("a" beside "a/b")."""
    taken = set(names)
    for name in names:
        parts = name.split("/")
        if "\0" in name or any(part in ("", ".", "..") or part.startswith("__") for part in parts):
            raise CheckpointError(f"{source}: tensor {name!r} cannot name a zarr array (an empty, "
                                  f"'.', '..' or '__' part): refused for --to zarr")
        for end in range(1, len(parts)):
            if "/".join(parts[:end]) in taken:
                raise CheckpointError(f"{source}: tensor {name!r} would be inside the zarr array "
                                      f"of tensor {'/'.join(parts[:end])!r}: refused for --to zarr")


@dataclasses.dataclass(slots=True)
class ConvertedFile:
    """One output file (or directory for zarr/infinity) and what it holds."""

    name: str
    tensors: int
    nbytes: int


@dataclasses.dataclass(slots=True)
class ConversionResult:
    destination: Path
    format: str
    files: list[ConvertedFile]
    tensors: int  # all verified against the source (shape, dtype, CRC-32C of the bytes)
    nbytes: int


class Conversion:
    """A planned conversion of the checkpoint at `source` (see the module docstring).

    `dtype` casts the floating-point model weights (None: as stored); `model_config` is a
    directory whose config.json / generation_config.json go with an hf output (default: the
    configs in the checkpoint's metadata, or config.json beside a DeepSpeed checkpoint).
    Raises CheckpointError for a bad source or an hf output without a model config.
    """

    def __init__(self, source: str | Path, *, to: str, tag: str | None = None,
                 dtype: torch.dtype | None = None, max_shard_nbytes: int = 5 << 30,
                 model_config: str | Path | None = None) -> None:
        if to not in FORMATS:
            raise CheckpointError(f"unknown output format {to!r}; choose one of {FORMATS}")
        if max_shard_nbytes <= 0:
            raise CheckpointError(f"max_shard_nbytes must be positive, got {max_shard_nbytes}")
        self.source: TensorSource = open_source(_run_checkpoints(Path(source), tag), tag)
        self.format = to
        self.max_shard_nbytes = max_shard_nbytes
        names = self.source.names()
        if to in ("hf", "safetensors", "torch"):
            names = [n for n in names if is_model_weight(n)]
        if to == "zarr":
            _check_zarr_names(names, self.source.path)
        self.dtypes = {n: self._output_dtype(n, dtype) for n in names}
        given = Path(model_config) if model_config else None
        self.configs = self._model_configs(given) if to == "hf" else {}
        self.tokenizer = _tokenizer_dir(given, self.source.path, self.source.path.parent,
                                        self.source.path.parent.parent) if to == "hf" else None

    @property
    def total_nbytes(self) -> int:
        """Bytes the output holds (verification reads as many again)."""
        return sum(self._nbytes(n) for n in self.dtypes)

    def run(self, destination: str | Path, on_progress: ProgressCallback | None = None) -> ConversionResult:
        """Write the output to `destination` (which must not exist; its parent must), verify it,
        publish it."""
        destination = Path(destination)
        if destination.exists():
            raise CheckpointError(f"{destination} exists; give a new output path")
        if not destination.parent.is_dir():  # made here, it would be debris after a failure
            raise CheckpointError(f"{destination.parent} does not exist; create it first")
        staging = destination.parent / f"{TEMPORARY_PREFIX}{destination.name}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
        try:
            with naming(destination):
                files, crcs = self._write(staging, on_progress)
            self._verify(staging, files, crcs, on_progress)
            fsync_tree(staging)
            replace_durably(staging, destination)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        logger.info("converted %s to %s (%s, %d tensors)", self.source.path, destination,
                    self.format, len(self.dtypes))
        return ConversionResult(destination, self.format, files, len(self.dtypes), self.total_nbytes)

    # -- planning --
    def _output_dtype(self, name: str, dtype: torch.dtype | None) -> torch.dtype:
        stored = self.source.dtype(name)
        if dtype is None or not stored.is_floating_point or not is_model_weight(name):
            return stored
        return dtype

    def _nbytes(self, name: str) -> int:
        return math.prod(self.source.shape(name)) * storage_dtype(dtype_name(self.dtypes[name])).itemsize

    def _model_configs(self, directory: Path | None) -> dict[str, dict[str, Any]]:
        """config.json (and generation_config.json) for an hf output, from the first place
        that has them: `directory`, the checkpoint's metadata, beside the checkpoint."""
        if directory is not None:
            if not (directory / "config.json").is_file():
                raise CheckpointError(f"--model-config {directory} holds no config.json")
            return _read_configs(directory)
        metadata = self.source.metadata
        if isinstance(metadata.get("model_config"), dict):
            found = {"config.json": metadata["model_config"]}
            if isinstance(metadata.get("generation_config"), dict):
                found["generation_config.json"] = metadata["generation_config"]
            return found
        for place in (self.source.path, self.source.path.parent):
            if (place / "config.json").is_file():
                return _read_configs(place)
        raise CheckpointError(f"--to hf needs the model's config.json: the checkpoint "
                              f"{self.source.path} has none; give --model-config DIR")

    # -- writing --
    def _write(self, staging: Path, on_progress: ProgressCallback | None) -> tuple[list[ConvertedFile], dict[str, int]]:
        """Write every tensor; returns the files and each tensor's CRC-32C as written."""
        crcs: dict[str, int] = {}

        def checked(name: str) -> Iterator[torch.Tensor]:
            """The source's pieces in the output dtype, their CRC-32C noted as they pass."""
            crc = 0
            for piece in self.source.iter_chunks(name):
                piece = piece.to(self.dtypes[name])
                crc = aio.crc32c(to_storage(piece).reshape(-1), crc)
                yield piece
            crcs[name] = crc

        if self.format in ("hf", "safetensors", "torch"):
            files = self._write_shards(staging, checked, on_progress)
        else:
            files = [self._write_arrays(staging, checked, on_progress)]
        for file, config in self.configs.items():
            (staging / file).write_text(json.dumps(self._with_dtype(file, config), indent=2))
        if self.tokenizer is not None:  # so AutoTokenizer loads from the output too
            for name in _TOKENIZER_FILES:
                if (self.tokenizer / name).is_file():
                    shutil.copyfile(self.tokenizer / name, staging / name)
        return files, crcs

    def _with_dtype(self, file: str, config: dict[str, Any]) -> dict[str, Any]:
        """config.json says the dtype the weights were written in (the most common floating
        one): from_pretrained loads them as that, not as the source model's."""
        floats = [d for d in self.dtypes.values() if d.is_floating_point]
        if file != "config.json" or not floats:
            return config
        name = str(max(set(floats), key=floats.count)).removeprefix("torch.")
        keys = [k for k in ("torch_dtype", "dtype") if k in config] or ["torch_dtype", "dtype"]
        return {**config, **{k: name for k in keys}}

    def _write_shards(self, staging: Path, checked, on_progress) -> list[ConvertedFile]:
        stem, suffix = ("model", ".safetensors") if self.format != "torch" else ("pytorch_model", ".bin")
        shards = plan_shards({n: self._nbytes(n) for n in self.dtypes}, self.max_shard_nbytes, stem, suffix)
        for file, names in shards:
            if self.format == "torch":
                tensors = {n: torch.cat(list(checked(n)) or [torch.empty(0, dtype=self.dtypes[n])])
                           .reshape(self.source.shape(n)) for n in names}
                torch.save(tensors, staging / file)
                if on_progress is not None:
                    on_progress(sum(self._nbytes(n) for n in names))
                del tensors
            else:
                specs = [(n, self.source.shape(n), self.dtypes[n]) for n in names]
                write_safetensors(staging / file, specs, checked, on_progress)
        if len(shards) > 1:
            write_index(staging / f"{stem}{suffix}.index.json", shards, self.total_nbytes)
        return [ConvertedFile(file, len(names), sum(self._nbytes(n) for n in names)) for file, names in shards]

    def _write_arrays(self, staging: Path, checked, on_progress) -> ConvertedFile:
        tag = getattr(self.source, "tag", None) or self.source.path.name
        if self.format == "infinity":
            metadata = {**self.source.metadata, "converted_from": str(self.source.path)}
            with CheckpointWriter(staging, tag, metadata=metadata, on_progress=on_progress) as writer:
                for name in self.dtypes:
                    sink = writer.open_tensor(name, self.source.shape(name), self.dtypes[name])
                    for piece in checked(name):
                        sink.write(piece)
                    sink.close()
            return ConvertedFile(tag, len(self.dtypes), self.total_nbytes)
        group = zarr.create_group(str(staging), attributes={"source": str(self.source.path)})
        for name in self.dtypes:
            shape = self.source.shape(name)
            entry = tensor_entry(name, shape, self.dtypes[name], name, DEFAULT_CHUNK_NBYTES)
            array = group.create_array(name, **array_options(entry))
            sink = TensorSink(array, entry, on_progress)
            for piece in checked(name):
                sink.write(piece)
            sink.close()
        return ConvertedFile(".", len(self.dtypes), self.total_nbytes)

    # -- checking --
    def _verify(self, staging: Path, files: list[ConvertedFile], crcs: dict[str, int],
                on_progress: ProgressCallback | None) -> None:
        """Read the output back; CheckpointError unless every tensor has the source's shape,
        the planned dtype and the bytes written."""
        seen: dict[str, tuple[tuple[int, ...], torch.dtype, int]] = {}
        for name, shape, dtype, pieces in self._read_back(staging, files):
            crc = 0
            for piece in pieces:
                flat = to_storage(piece).reshape(-1) if isinstance(piece, torch.Tensor) else piece
                crc = aio.crc32c(flat, crc)
                if on_progress is not None:
                    on_progress(flat.nbytes)
            seen[name] = (tuple(shape), dtype, crc)
        for name, dtype in self.dtypes.items():
            shape = tuple(self.source.shape(name))
            if name not in seen:
                raise CheckpointError(f"verification: tensor {name!r} is missing from the output")
            got_shape, got_dtype, got_crc = seen[name]
            if (got_shape, got_dtype, got_crc) != (shape, dtype, crcs[name]):
                raise CheckpointError(f"verification: tensor {name!r} reads back as {got_shape} "
                                      f"{got_dtype} crc {got_crc:#x}, wrote {shape} {dtype} crc "
                                      f"{crcs[name]:#x}")

    def _read_back(self, staging: Path, files: list[ConvertedFile]) -> Iterator[tuple[str, Any, torch.dtype, Iterable]]:
        """(name, shape, dtype, flat pieces) of each output tensor; pieces are bounded (a chunk
        or a read block) except for torch shards, which are loaded whole."""
        if self.format in ("hf", "safetensors"):
            for file in files:
                yield from read_safetensors(staging / file.name, DEFAULT_CHUNK_NBYTES)
        elif self.format == "torch":
            for file in files:
                for name, tensor in torch.load(staging / file.name, mmap=True, weights_only=True).items():
                    yield name, tensor.shape, tensor.dtype, [tensor]
        elif self.format == "infinity":
            reader = CheckpointReader(staging)
            for name in reader.names():
                yield name, reader.shape(name), reader.dtype(name), reader.iter_chunks(name)
        else:
            group = zarr.open_group(str(staging), mode="r")
            for name in self.dtypes:
                array = group[name]
                dtype = torch_dtype(array.attrs["dtype"])
                yield name, array.shape if self.source.shape(name) else (), dtype, self._zarr_rows(array)

    @staticmethod
    def _zarr_rows(array: Any) -> Iterator[torch.Tensor]:
        rows = array.chunks[0]
        for start in range(0, array.shape[0] if array.size else 0, rows):
            yield from_storage(array[start:start + rows], array.attrs["dtype"])
