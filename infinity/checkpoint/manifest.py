"""The manifest of an Infinity checkpoint: what tensors it holds, where, and their checksums.

`manifest.json` is the last file written into a tag's directory, so a tag without one is never
complete (see [Note: durable commit] in _durable.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from infinity.checkpoint._common import storage_dtype
from infinity.errors import CheckpointError

FORMAT_NAME = "infinity-checkpoint"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"


@dataclasses.dataclass(slots=True)
class TensorEntry:
    """One tensor: a zarr v3 array chunked along dim 0, `chunk_rows` rows per chunk."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # logical dtype name ("bfloat16"; stored as uint16 bits)
    array: str  # the zarr array's directory, relative to the tag's directory
    chunk_rows: int  # rows of dim 0 per chunk (a 0-d tensor is stored as shape (1,))
    crc32c: list[int]  # CRC-32C of each chunk's stored bytes, in chunk order

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * storage_dtype(self.dtype).itemsize

    @property
    def stored_shape(self) -> tuple[int, ...]:
        return self.shape or (1,)

    @property
    def row_numel(self) -> int:
        return math.prod(self.stored_shape[1:])

    @property
    def chunk_count(self) -> int:
        return math.ceil(self.stored_shape[0] / self.chunk_rows) if self.numel else 0

    def chunk_rows_range(self, index: int) -> tuple[int, int]:
        """[start, stop) rows of dim 0 held by chunk `index`."""
        start = index * self.chunk_rows
        return start, min(start + self.chunk_rows, self.stored_shape[0])

    def chunk_file(self, tag_dir: Path, index: int) -> Path:
        """The file holding chunk `index` (zarr's default chunk key encoding, "/" separator)."""
        return tag_dir / self.array / "c" / str(index) / Path(*(["0"] * (len(self.stored_shape) - 1)))


@dataclasses.dataclass(slots=True)
class Manifest:
    tag: str
    tensors: list[TensorEntry]
    metadata: dict[str, Any]  # free-form JSON: step counts, client_state, the model's config, ...
    version: int = FORMAT_VERSION

    def to_json(self) -> str:
        body = {"format": FORMAT_NAME, "version": self.version, "tag": self.tag,
                "metadata": self.metadata,
                "tensors": [dataclasses.asdict(entry) for entry in self.tensors]}
        try:
            return json.dumps(body, indent=1)
        except TypeError as e:
            raise CheckpointError(f"checkpoint metadata must be JSON (dicts, lists, str, numbers, "
                                  f"bool, None); store tensors with add(): {e}") from None

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """Parse `path`; CheckpointError naming the file when it is no manifest of a version
        this code reads."""
        try:
            body = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path.parent} is not a complete Infinity checkpoint: "
                                  f"{path.name} is missing") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path} cannot be read as a checkpoint manifest: {e}") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{path} is not an Infinity checkpoint manifest")
        if body.get("version") != FORMAT_VERSION:
            raise CheckpointError(f"{path} has checkpoint format version {body.get('version')!r}; "
                                  f"this Infinity reads version {FORMAT_VERSION} (upgrade Infinity)")
        try:
            tensors = [TensorEntry(name=t["name"], shape=tuple(t["shape"]), dtype=t["dtype"],
                                   array=t["array"], chunk_rows=t["chunk_rows"], crc32c=list(t["crc32c"]))
                       for t in body["tensors"]]
            return cls(tag=body["tag"], tensors=tensors, metadata=body["metadata"])
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{path} is a damaged manifest (missing field {e})") from None
