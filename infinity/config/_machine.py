"""How much host memory this process may use: /proc/meminfo, capped by a cgroup v2 limit."""

from __future__ import annotations

import os
from pathlib import Path

_CGROUP = Path("/sys/fs/cgroup")


def _meminfo_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == field:
                return int(rest.split()[0]) * 1024  # the file counts in KiB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_bytes(name: str) -> int | None:
    """A cgroup v2 memory file of this process's cgroup as bytes; None if absent or "max"."""
    try:
        text = (_CGROUP / name).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def total_memory_bytes() -> int:
    """Physical memory, or the cgroup's limit when that is lower."""
    total = _meminfo_bytes("MemTotal") or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _cgroup_bytes("memory.max")
    return min(total, limit) if limit else total


def available_memory_bytes() -> int:
    """Memory a new allocation can get now: MemAvailable, or what the cgroup has left."""
    available = _meminfo_bytes("MemAvailable") or total_memory_bytes() // 2
    limit, used = _cgroup_bytes("memory.max"), _cgroup_bytes("memory.current")
    if limit is not None and used is not None:
        available = min(available, max(0, limit - used))
    return available
