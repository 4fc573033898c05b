"""What this process uses of the machine: resident memory (from /proc) and the cores it may run on.

One reader for every layer: the engine's stats, the trainer's progress line and the benchmarks'
peak RSS all mean VmRSS / VmHWM of /proc/self/status, never an estimate from tensor sizes.
"""

from __future__ import annotations

import os


def _status_bytes(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def rss_bytes() -> int:
    """Current resident set (VmRSS) of this process, 0 where /proc is missing."""
    return _status_bytes("VmRSS:")


def peak_rss_bytes() -> int:
    """Peak resident set (VmHWM) of this process, 0 where /proc is missing. The peak never
    goes down: measure work in a fresh child process for a clean figure."""
    return _status_bytes("VmHWM:")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), the default thread count of kernels."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
