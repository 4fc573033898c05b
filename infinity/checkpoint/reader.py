"""Reading an Infinity checkpoint: any tensor or slice, verified against the manifest's checksums.

A chunk is the unit read and verified: reading rows [a, b) reads the chunks that hold them,
checks each one's CRC-32C and returns the rows. A flipped byte, a truncated or missing chunk
file raises CheckpointError naming the tensor and the file; silently wrong weights never leave.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import zarr

import aio
from infinity.checkpoint._common import ProgressCallback, from_storage, storage_dtype, torch_dtype
from infinity.checkpoint.manifest import MANIFEST_NAME, Manifest, TensorEntry
from infinity.checkpoint.writer import LATEST_NAME, check_tag
from infinity.errors import CheckpointError
from infinity.paths import inside

logger = logging.getLogger(__name__)


def latest_tag(directory: str | Path) -> str | None:
    """The tag `directory/latest` names, or None when there is no `latest` file;
    CheckpointError when it names no tag directory inside `directory`."""
    latest = Path(directory) / LATEST_NAME
    try:
        inside(directory, LATEST_NAME, source=directory)
        tag = latest.read_bytes().decode().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{latest} cannot be read as a tag: {e}") from None
    try:
        check_tag(tag)
    except CheckpointError as e:
        raise CheckpointError(f"{latest}: {e}") from None
    inside(directory, tag, source=latest)
    return tag


def is_infinity_checkpoint(directory: str | Path) -> bool:
    """Whether `directory` is a run directory (with `latest`) or a tag of an Infinity checkpoint."""
    directory = Path(directory)
    if (directory / MANIFEST_NAME).is_file():
        return True
    try:
        tag = latest_tag(directory)
    except CheckpointError:
        return False
    return tag is not None and (directory / tag / MANIFEST_NAME).is_file()


class CheckpointReader:
    """One committed tag: `directory` is the run directory (tag None: the one `latest` names) or
    the tag's own directory. Raises CheckpointError when it is no complete checkpoint or has a
    format version this code does not read."""

    def __init__(self, directory: str | Path, tag: str | None = None) -> None:
        directory = Path(directory)
        if tag is None and (directory / MANIFEST_NAME).is_file():
            self.path = directory
        else:
            if tag is None:
                tag = latest_tag(directory)
                if tag is None:
                    raise CheckpointError(f"{directory} holds no '{LATEST_NAME}' file and no "
                                          f"{MANIFEST_NAME}: not an Infinity checkpoint (give a tag)")
            self.path = inside(directory, check_tag(tag), source=f"tag {tag!r}")
        self.manifest = Manifest.read(inside(self.path, MANIFEST_NAME, source=self.path))
        self._entries = {entry.name: entry for entry in self.manifest.tensors}
        self._arrays: dict[str, Any] = {}
        self._check_every_array_listed()

    @property
    def tag(self) -> str:
        return self.manifest.tag

    @property
    def metadata(self) -> dict[str, Any]:
        return self.manifest.metadata

    def names(self) -> list[str]:
        """Tensor names in the order they were written."""
        return list(self._entries)

    def entry(self, name: str) -> TensorEntry:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.path} holds no tensor {name!r}") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return torch_dtype(self.entry(name).dtype)

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor `name`, or rows `rows` (a step-1 slice of dim 0) of it, verified."""
        entry = self.entry(name)
        if rows is None:
            return self.read_flat(name, 0, entry.numel).reshape(entry.shape)
        start, stop, step = rows.indices(entry.stored_shape[0])
        if step != 1:
            raise CheckpointError(f"read({name!r}, rows) takes a step-1 slice, got {rows}")
        if not entry.shape:
            raise CheckpointError(f"tensor {name!r} is 0-d; read it without rows")
        stop = max(start, stop)
        flat = self.read_flat(name, start * entry.row_numel, stop * entry.row_numel)
        return flat.reshape(stop - start, *entry.shape[1:])

    def read_flat(self, name: str, start: int, stop: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, stop) of tensor `name` flattened, verified, reading only the chunks
        that hold them: a rank's ZeRO-3 partition (elements [r*p, (r+1)*p)) for any number of
        ranks, whatever partitioning wrote the checkpoint. They are copied chunk by chunk into
        `out` (1-D, stop - start elements, any dtype: converted as copied) when given, so a
        caller with the destination at hand holds one chunk at a time, else into a new tensor."""
        entry = self.entry(name)
        if not 0 <= start <= stop <= entry.numel:
            raise CheckpointError(f"read_flat({name!r}, {start}, {stop}): tensor {name!r} has "
                                  f"{entry.numel} elements")
        if out is None:
            out = torch.empty(stop - start, dtype=self.dtype(name))
        elif out.dim() != 1 or out.numel() != stop - start:
            raise ValueError(f"read_flat({name!r}, {start}, {stop}): out must be 1-D with "
                             f"{stop - start} elements, got shape {tuple(out.shape)}")
        chunk_numel = entry.chunk_rows * entry.row_numel
        for index in range(start // chunk_numel, -(-stop // chunk_numel) if stop > start else 0):
            chunk = self._read_chunk(entry, index)
            base = index * chunk_numel
            lo, hi = max(start, base), min(stop, base + chunk.numel())
            out[lo - start:hi - start] = chunk[lo - base:hi - base]
        return out

    def iter_chunks(self, name: str, on_progress: ProgressCallback | None = None) -> Iterator[torch.Tensor]:
        """Tensor `name`'s elements as flat, verified pieces of one chunk each, in order: a
        caller streaming the tensor elsewhere holds one chunk at a time."""
        entry = self.entry(name)
        for index in range(entry.chunk_count):
            chunk = self._read_chunk(entry, index)
            if on_progress is not None:
                on_progress(chunk.numel() * chunk.element_size())
            yield chunk

    def verify(self, on_progress: ProgressCallback | None = None) -> None:
        """Read and check every chunk of every tensor; CheckpointError at the first bad one."""
        for name in self._entries:
            for _ in self.iter_chunks(name, on_progress):
                pass

    def _check_every_array_listed(self) -> None:
        """CheckpointError when an array directory has no manifest entry (an entry renamed to
        another's name, or lost): the manifest is damaged."""
        listed = {Path(entry.array) for entry in self.manifest.tensors}
        arrays = self.path / "arrays"
        for found in sorted(arrays.iterdir()) if arrays.is_dir() else ():
            if found.relative_to(self.path) not in listed:
                raise CheckpointError(f"{self.path / MANIFEST_NAME} is a damaged manifest: no "
                                      f"entry names the array {found}")

    def _array(self, entry: TensorEntry) -> Any:
        """The zarr array of `entry`, checked to be the one the writer made for it."""
        if entry.name not in self._arrays:
            array_dir = self.path / entry.array
            inside(self.path, f"{entry.array}/zarr.json", source=self.path / MANIFEST_NAME)
            try:
                array = zarr.open_array(str(array_dir), mode="r")
                facts = (array.attrs.get("name"), array.attrs.get("dtype"), array.dtype,
                         array.shape, array.chunks[0])
            except Exception as e:  # zarr raises several types for a damaged zarr.json
                raise CheckpointError(f"tensor {entry.name!r}: its zarr array {array_dir} cannot "
                                      f"be opened: {e}") from e
            if facts != (entry.name, entry.dtype, storage_dtype(entry.dtype), entry.stored_shape,
                         entry.chunk_rows):
                raise CheckpointError(f"tensor {entry.name!r}: its zarr array {array_dir} holds "
                                      f"{facts[0]!r} ({facts[1]}, shape {facts[3]}, chunks of "
                                      f"{facts[4]} rows), not what the manifest says: damaged")
            self._arrays[entry.name] = array
        return self._arrays[entry.name]

    def _read_chunk(self, entry: TensorEntry, index: int) -> torch.Tensor:
        """Chunk `index` of `entry` as a flat tensor, after its checksum matched."""
        path = entry.chunk_file(self.path, index)
        if index >= len(entry.crc32c):
            raise CheckpointError(f"tensor {entry.name!r}: the manifest has no checksum for chunk "
                                  f"{index} ({path})")
        if not path.is_file():
            raise CheckpointError(f"tensor {entry.name!r}: chunk file {path} is missing")
        inside(self.path, str(path.relative_to(self.path)), source=self.path / MANIFEST_NAME)
        start, stop = entry.chunk_rows_range(index)
        try:
            data = self._array(entry)[start:stop]
        except CheckpointError:
            raise
        except Exception as e:  # a short file fails zarr's decode with ValueError and others
            raise CheckpointError(f"tensor {entry.name!r}: chunk file {path} is damaged or "
                                  f"truncated: {e}") from e
        if aio.crc32c(data) != entry.crc32c[index]:
            raise CheckpointError(f"tensor {entry.name!r}: chunk file {path} does not match its "
                                  f"checksum (corrupted)")
        return from_storage(data, entry.dtype).reshape(-1)
