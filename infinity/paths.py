"""Paths read from files: a manifest's arrays, a safetensors index's shards, the tag in a
`latest` file. Each must name something inside the folder the file was found in, symlinks
followed, so a handed-in file cannot make a reader open anything outside it.

One exception: a Hugging Face hub cache snapshot (`models--org--name/snapshots/<revision>/`)
holds symlinks into the repository's own `blobs/` folder, which count as inside.

And the other way round: an OSError of a write (a full disk) names the path it was writing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from infinity.errors import CheckpointError


def _hub_blob(root: Path, target: Path) -> bool:
    """Whether `target` is a blob of the hub cache repository whose snapshot `root` is."""
    return root.parent.name == "snapshots" and target.parent == root.parent.parent / "blobs"


def inside(folder: str | os.PathLike[str], entry: object, *,
           source: str | os.PathLike[str]) -> Path:
    """`folder / entry` when `entry` (read from the file `source`) is a relative path that stays
    inside `folder` once resolved; CheckpointError naming `source` and the entry otherwise."""
    if not isinstance(entry, str) or not entry or "\0" in entry:
        raise CheckpointError(f"{source}: {entry!r} is not a path", path=os.fspath(source))
    if os.path.isabs(entry):
        raise CheckpointError(f"{source}: {entry!r} is an absolute path; only paths inside "
                              f"{folder} are read", path=os.fspath(source))
    root = Path(folder).resolve()
    target = (root / entry).resolve()
    if target != root and root not in target.parents and not _hub_blob(root, target):
        raise CheckpointError(f"{source}: {entry!r} leads outside {folder} (to {target}); only "
                              f"paths inside it are read", path=os.fspath(source))
    return Path(folder) / entry


@contextlib.contextmanager
def naming(path: str | os.PathLike[str]) -> Iterator[None]:
    """An OSError inside that names no file (write() on a full disk names none) is raised again
    naming `path`, so the one line a user reads says where the space ran out."""
    try:
        yield
    except OSError as e:
        if e.filename is not None or e.errno is None or type(e).__module__ != "builtins":
            raise
        raise OSError(e.errno, e.strerror, os.fspath(path)) from e
