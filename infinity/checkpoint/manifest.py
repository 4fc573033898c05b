"""The manifest of an Infinity checkpoint: what tensors it holds, where, and their checksums.

`manifest.json` is the last file written into a tag's directory, so a tag without one is never
complete (see [Note: durable commit] in _durable.py).

[Note: manifest checksum] The manifest carries "crc32c", the CRC-32C of its own body without
that key (canonical JSON: sorted keys, no spaces), so a changed byte in it - a renamed or
duplicated tensor, another array, chunk count or checksum - is refused when it is read, not
found out as missing or wrong weights. Manifests written before the checksum existed have no
"crc32c": they are read with a warning (their chunks are still checked, and so are the rules
below), since refusing them would strand every older checkpoint. Every field is checked for
its type; names and arrays are unique, arrays stay inside the tag directory, and each tensor
has one chunk checksum per chunk.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path
from typing import Any

import aio
from infinity.checkpoint._common import DTYPES, storage_dtype
from infinity.errors import CheckpointError
from infinity.paths import inside

logger = logging.getLogger(__name__)

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
            body["crc32c"] = _checksum(body)  # See [Note: manifest checksum]
            return json.dumps(body, indent=1)
        except (TypeError, ValueError) as e:
            raise CheckpointError(f"checkpoint metadata must be JSON (dicts, lists, str, numbers, "
                                  f"bool, None); store tensors with add(): {e}") from None

    @classmethod
    def read(cls, path: Path) -> Manifest:
        """Parse and check `path`; CheckpointError naming the file when it is no manifest of a
        version this code reads, or a damaged one (see [Note: manifest checksum])."""
        try:
            body = json.loads(path.read_bytes())
        except FileNotFoundError:
            raise CheckpointError(f"{path.parent} is not a complete Infinity checkpoint: "
                                  f"{path.name} is missing") from None
        except (OSError, ValueError, RecursionError) as e:
            raise CheckpointError(f"{path} cannot be read as a checkpoint manifest: {e}") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
            raise CheckpointError(f"{path} is not an Infinity checkpoint manifest")
        if body.get("version") != FORMAT_VERSION:
            raise CheckpointError(f"{path} has checkpoint format version {body.get('version')!r}; "
                                  f"this Infinity reads version {FORMAT_VERSION} (upgrade Infinity)")
        _check_checksum(path, body)
        unknown = set(body) - {"format", "version", "tag", "metadata", "tensors"}
        if unknown:
            raise CheckpointError(f"{path} is a damaged manifest (unknown field "
                                  f"{sorted(unknown)[0]!r})")
        try:
            tensors = [_entry(path, t) for t in body["tensors"]]
            manifest = cls(tag=body["tag"], tensors=tensors, metadata=body["metadata"])
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{path} is a damaged manifest (missing or wrong field "
                                  f"{e})") from None
        if not isinstance(manifest.tag, str) or not isinstance(manifest.metadata, dict):
            raise CheckpointError(f"{path} is a damaged manifest (tag or metadata of the wrong "
                                  f"type)")
        for field in ("name", "array"):
            seen: set[str] = set()
            for entry in tensors:
                value = getattr(entry, field)
                if value in seen:
                    raise CheckpointError(f"{path} is a damaged manifest: two tensors have the "
                                          f"{field} {value!r}")
                seen.add(value)
        return manifest


def _checksum(body: dict[str, Any]) -> int:
    text = json.dumps({k: v for k, v in body.items() if k != "crc32c"}, sort_keys=True,
                      separators=(",", ":"))
    return aio.crc32c(text.encode())


def _check_checksum(path: Path, body: dict[str, Any]) -> None:
    """See [Note: manifest checksum]."""
    if "crc32c" not in body:
        logger.warning("%s has no checksum of its own (written before Infinity checked "
                       "manifests): a damaged entry is caught only by the checks of each field",
                       path)
        return
    if body.pop("crc32c") != _checksum(body):
        raise CheckpointError(f"{path} does not match its checksum: the manifest is damaged")


def _int(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _entry(path: Path, t: Any) -> TensorEntry:
    """One tensor's entry, every field checked (TypeError / KeyError name what is wrong)."""
    if not isinstance(t, dict) or set(t) != {f.name for f in dataclasses.fields(TensorEntry)}:
        raise TypeError(f"tensor entry {t!r:.200}")
    name, shape, crcs = t["name"], t["shape"], t["crc32c"]
    if not isinstance(name, str) or not name:
        raise TypeError(f"name {name!r}")
    if not isinstance(shape, list) or not all(_int(d, 0) for d in shape):
        raise TypeError(f"shape {shape!r} of {name!r}")
    if t["dtype"] not in DTYPES:
        raise TypeError(f"dtype {t['dtype']!r} of {name!r}")
    if not _int(t["chunk_rows"], 1):
        raise TypeError(f"chunk_rows {t['chunk_rows']!r} of {name!r}")
    inside(path.parent, t["array"], source=path)
    entry = TensorEntry(name=name, shape=tuple(shape), dtype=t["dtype"], array=t["array"],
                        chunk_rows=t["chunk_rows"], crc32c=crcs)
    if (not isinstance(crcs, list) or len(crcs) != entry.chunk_count
            or not all(_int(c, 0) and c < 1 << 32 for c in crcs)):
        raise TypeError(f"crc32c of {name!r}: {entry.chunk_count} checksums expected")
    return entry
