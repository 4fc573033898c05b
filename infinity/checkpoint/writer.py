"""Writing an Infinity checkpoint tensor by tensor (or slice by slice), committed atomically.

    with CheckpointWriter(run_dir, "step100", metadata={"step": 100}) as writer:
        writer.add("layer.weight", weight)                  # a whole tensor
        sink = writer.open_tensor("huge", (n, d), torch.float32)
        for piece in pieces:                                # flat, in order, any sizes
            sink.write(piece)
        sink.close()
    # on leaving the block: fsynced, renamed to run_dir/step100, run_dir/latest = "step100"

Memory: one chunk (`chunk_nbytes`) per open sink, plus the caller's piece. A crash at any moment
leaves the tags committed before it intact and `latest` naming a complete one; the half-written
tag is a `.tmp-*` directory that the next writer of `run_dir` removes.
One writer per directory at a time.
"""

from __future__ import annotations

import logging
import math
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr

import aio
from infinity.checkpoint._common import ProgressCallback, dtype_name, storage_dtype, to_storage
from infinity.checkpoint._durable import (
    TEMPORARY_PREFIX,
    fsync_path,
    fsync_tree,
    replace_durably,
    write_text_atomically,
)
from infinity.checkpoint.manifest import MANIFEST_NAME, Manifest, TensorEntry
from infinity.errors import CheckpointError
from infinity.paths import naming

logger = logging.getLogger(__name__)

DEFAULT_CHUNK_NBYTES = 8 << 20
LATEST_NAME = "latest"


def check_tag(tag: str) -> str:
    """`tag` if it can name a checkpoint directory; CheckpointError saying why not."""
    if (not isinstance(tag, str) or not tag or tag in (".", "..", LATEST_NAME) or "/" in tag
            or "\0" in tag or tag.startswith(".")):
        raise CheckpointError(f"checkpoint tag {tag!r} cannot name a directory: use letters, "
                              f"digits, '_', '-' (not '{LATEST_NAME}', no '/', no leading '.')")
    return tag


# [Note: publishing a tag] A save killed after renaming its tag into place but before replacing
# `latest` leaves a complete tag that `latest` does not name; a run resumed from `latest` then
# saves that tag again. So the tag is named in PUBLISHING_NAME (durably) before the rename and
# the file is removed after `latest`; the next writer finds the file and retires the tag it
# names unless `latest` names it. Older tags that `latest` no longer names are never touched.
PUBLISHING_NAME = f"{TEMPORARY_PREFIX}publishing"


def retire_unpublished(directory: Path) -> None:
    """Set aside (as debris) a tag whose save was killed before `latest` named it."""
    try:
        tag = (directory / PUBLISHING_NAME).read_text().strip()
    except FileNotFoundError:
        return
    try:
        latest = (directory / LATEST_NAME).read_text().strip()
    except FileNotFoundError:
        latest = None
    if tag and tag != latest and (directory / tag).exists():
        aside = directory / f"{TEMPORARY_PREFIX}unpublished-{tag}-{uuid.uuid4().hex[:8]}"
        replace_durably(directory / tag, aside)
        logger.warning("removing %s: its save was interrupted before latest named it", directory / tag)


def remove_debris(directory: Path) -> None:
    """Remove what crashed writers left in `directory` (the `.tmp-*` entries)."""
    for path in directory.glob(f"{TEMPORARY_PREFIX}*"):
        logger.info("removing %s, left by an interrupted checkpoint save", path)
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def tensor_entry(name: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, array: str,
                 chunk_nbytes: int) -> TensorEntry:
    """The entry of a tensor about to be written: chunks of whole rows of dim 0, each at most
    `chunk_nbytes` (or one row, when a row is larger)."""
    shape = tuple(int(d) for d in shape)
    stored = shape or (1,)
    row_nbytes = math.prod(stored[1:]) * storage_dtype(dtype_name(dtype)).itemsize
    chunk_rows = max(1, chunk_nbytes // row_nbytes) if row_nbytes else max(1, stored[0])
    return TensorEntry(name=name, shape=shape, dtype=dtype_name(dtype), array=array,
                       chunk_rows=min(chunk_rows, max(1, stored[0])), crc32c=[])


def array_options(entry: TensorEntry) -> dict[str, Any]:
    """zarr.create_array keywords for `entry`: raw little-endian chunks (no compression, so a
    chunk file is the tensor's bytes), every chunk written even when all zeros."""
    return {"shape": entry.stored_shape,
            "chunks": (entry.chunk_rows, *(max(1, d) for d in entry.stored_shape[1:])),
            "dtype": storage_dtype(entry.dtype), "compressors": None, "fill_value": 0,
            "config": {"write_empty_chunks": True},
            "attributes": {"name": entry.name, "dtype": entry.dtype}}


class TensorSink:
    """Receives one tensor's elements in order, as flat pieces of any size, and writes whole
    chunks. Holds at most one chunk. Get one from CheckpointWriter.open_tensor."""

    def __init__(self, array: Any, entry: TensorEntry, on_progress: ProgressCallback | None) -> None:
        self._array = array
        self._entry = entry
        self._on_progress = on_progress
        self._chunk = np.empty(entry.chunk_rows * entry.row_numel, storage_dtype(entry.dtype))  # 1D
        self._filled = 0  # elements in self._chunk
        self._written = 0  # elements already written to chunks
        self.closed = False

    def write(self, piece: torch.Tensor) -> None:
        """Append `piece`'s elements (flattened; its dtype must be the tensor's)."""
        if self.closed:
            raise CheckpointError(f"tensor {self._entry.name!r} is closed; open_tensor it again")
        if dtype_name(piece.dtype) != self._entry.dtype:
            raise CheckpointError(f"tensor {self._entry.name!r} is {self._entry.dtype}, got a "
                                  f"{piece.dtype} piece; cast it first")
        flat = to_storage(piece).reshape(-1)
        if self._written + self._filled + flat.size > self._entry.numel:
            raise CheckpointError(f"tensor {self._entry.name!r} has {self._entry.numel} elements; "
                                  f"the pieces written exceed it")
        while flat.size:
            take = min(flat.size, self._chunk.size - self._filled)
            self._chunk[self._filled:self._filled + take] = flat[:take]
            self._filled += take
            flat = flat[take:]
            if self._filled == self._chunk.size:
                self._flush()

    def close(self) -> None:
        """Write the last, partial chunk; CheckpointError if elements are missing."""
        if self.closed:
            return
        if self._filled:
            self._flush()
        if self._written != self._entry.numel:
            raise CheckpointError(f"tensor {self._entry.name!r} got {self._written} of its "
                                  f"{self._entry.numel} elements before close()")
        self.closed = True

    def _flush(self) -> None:
        index = len(self._entry.crc32c)
        start, stop = self._entry.chunk_rows_range(index)
        data = self._chunk[:self._filled]
        if data.size != (stop - start) * self._entry.row_numel:
            return  # a partial chunk that is not the last: more pieces are coming
        store = self._array.store_path
        with naming(Path(store.store.root) / store.path):
            self._array[start:stop] = data.reshape((stop - start, *self._entry.stored_shape[1:]))
        self._entry.crc32c.append(aio.crc32c(data))
        self._written += data.size
        self._filled = 0
        if self._on_progress is not None:
            self._on_progress(data.nbytes)


class CheckpointWriter:
    """Writes the tag `tag` under `directory`; see the module docstring.

    Parameters: `metadata` is free-form JSON kept in the manifest (steps, client_state, model
    config); `chunk_nbytes` bounds a chunk (the unit a reader reads and verifies); with
    `update_latest` the commit points `directory/latest` at the tag; `on_progress` gets the
    bytes of each chunk written. Raises CheckpointError when the tag exists.
    """

    def __init__(self, directory: str | Path, tag: str, *, metadata: dict[str, Any] | None = None,
                 chunk_nbytes: int = DEFAULT_CHUNK_NBYTES, update_latest: bool = True,
                 on_progress: ProgressCallback | None = None) -> None:
        self.directory = Path(directory)
        self.tag = check_tag(tag)
        self.metadata: dict[str, Any] = dict(metadata or {})
        if chunk_nbytes <= 0:
            raise CheckpointError(f"chunk_nbytes must be positive, got {chunk_nbytes}")
        self._chunk_nbytes = chunk_nbytes
        self._update_latest = update_latest
        self._on_progress = on_progress
        self.directory.mkdir(parents=True, exist_ok=True)
        retire_unpublished(self.directory)
        remove_debris(self.directory)
        self._check_free()
        self._staging = self.directory / f"{TEMPORARY_PREFIX}{tag}-{uuid.uuid4().hex[:8]}"
        self._staging.mkdir()
        self._entries: list[TensorEntry] = []
        self._sinks: list[TensorSink] = []
        self._names: set[str] = set()

    @property
    def path(self) -> Path:
        """Where the tag lives once committed."""
        return self.directory / self.tag

    def open_tensor(self, name: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> TensorSink:
        """A sink for tensor `name`; write its elements in order, then close() it."""
        if name in self._names:
            raise CheckpointError(f"tensor {name!r} is already in checkpoint {self.tag!r}")
        entry = tensor_entry(name, shape, dtype, f"arrays/{len(self._entries)}", self._chunk_nbytes)
        array = zarr.create_array(store=str(self._staging / entry.array), **array_options(entry))
        self._names.add(name)
        self._entries.append(entry)
        sink = TensorSink(array, entry, self._on_progress)
        self._sinks.append(sink)
        return sink

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Write the whole of `tensor` as `name` (any device; copied to host chunk by chunk)."""
        sink = self.open_tensor(name, tensor.shape, tensor.dtype)
        flat = tensor.detach().reshape(-1)
        step = max(1, self._chunk_nbytes // max(1, tensor.element_size()))
        for start in range(0, flat.numel(), step):
            sink.write(flat[start:start + step])
        sink.close()

    def commit(self) -> Path:
        """Write the manifest, make everything durable, publish the tag (and `latest`)."""
        unclosed = [s._entry.name for s in self._sinks if not s.closed]
        if unclosed:
            raise CheckpointError(f"tensors {unclosed} of checkpoint {self.tag!r} were not closed")
        manifest = Manifest(tag=self.tag, tensors=self._entries, metadata=self.metadata)
        with naming(self._staging / MANIFEST_NAME):
            (self._staging / MANIFEST_NAME).write_text(manifest.to_json())
        fsync_tree(self._staging)  # See [Note: durable commit]
        self._check_free()
        if self._update_latest:  # See [Note: publishing a tag]
            write_text_atomically(self.directory / PUBLISHING_NAME, self.tag + "\n")
        replace_durably(self._staging, self.path)
        if self._update_latest:
            write_text_atomically(self.directory / LATEST_NAME, self.tag + "\n")
            (self.directory / PUBLISHING_NAME).unlink()
            fsync_path(self.directory)
        logger.info("checkpoint %s committed (%d tensors)", self.path, len(self._entries))
        return self.path

    def abort(self) -> None:
        """Drop what was written; the directory is as before this writer."""
        shutil.rmtree(self._staging, ignore_errors=True)
        fsync_path(self.directory)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def _check_free(self) -> None:
        if self.path.exists():
            raise CheckpointError(f"checkpoint {self.path} exists; save under another tag or "
                                  f"delete it first")
