"""Checking at load that an NVMe directory can hold swap files, so no step fails on it later."""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from infinity.errors import ConfigPathError


def _fail(code: int, key: str, why: str, path: Path) -> ConfigPathError:
    return ConfigPathError(code, f"{key}: {why} ({os.strerror(code)})", str(path))


def check_writable_dir(path: str, key: str) -> None:
    """Raise ConfigPathError (an OSError and a ConfigError) naming `key` and `path` unless `path`
    is a writable directory, or does not exist yet but could be created. Creates nothing that
    stays: an existing directory is probed with a temporary file, which is removed.
    """
    target = Path(path).expanduser()
    if target.exists():
        if not target.is_dir():
            raise _fail(errno.ENOTDIR, key, "is not a directory", target)
        try:
            with tempfile.TemporaryFile(dir=target):
                pass
        except OSError as exc:
            raise _fail(exc.errno or errno.EACCES, key, "cannot create files in it",
                        target) from None
        return
    ancestor = target.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise _fail(errno.ENOTDIR, key, f"its parent {ancestor} is not a directory", target)
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise _fail(errno.EACCES, key, f"does not exist and cannot be created in {ancestor}",
                    target)
