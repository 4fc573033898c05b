"""Making files and renames survive a crash: fsync of files and directories, atomic replace.

[Note: durable commit] A rename is durable only once the directory holding it is fsynced, and a
file's bytes only once the file is; so a checkpoint is fsynced file by file, then directory by
directory bottom up, before the rename that publishes it.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

# Names of files and directories being written; whatever carries it after a crash is debris
# that the next writer of the directory removes.
TEMPORARY_PREFIX = ".tmp-"


def fsync_path(path: Path) -> None:
    """fsync a file or a directory by path."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every directory bottom up, `root` last."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(Path(dirpath))


def replace_durably(source: Path, target: Path) -> None:
    """Rename `source` to `target` (atomic on POSIX) and fsync the directory holding both."""
    os.replace(source, target)
    fsync_path(target.parent)


def write_text_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` so a crash leaves either the old or the new content, whole."""
    temporary = path.with_name(f"{TEMPORARY_PREFIX}{path.name}-{uuid.uuid4().hex[:8]}")
    try:
        with open(temporary, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        replace_durably(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
