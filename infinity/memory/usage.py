"""What this process uses of the machine: resident memory (from /proc) and the cores it may run on.

One reader for every layer: the engine's stats, the trainer's progress line and the benchmarks'
peak RSS all mean VmRSS / VmHWM of /proc/self/status, never an estimate from tensor sizes.
"""

from __future__ import annotations

import os


def _status(*fields: str) -> dict[str, int]:
    """The named fields of /proc/self/status in bytes (their kB times 1024); 0 where /proc is
    missing."""
    found = dict.fromkeys(fields, 0)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in found:
                    found[name] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return found


def rss_bytes() -> int:
    """Current resident set (VmRSS) of this process, 0 where /proc is missing."""
    return _status("VmRSS")["VmRSS"]


def peak_rss_bytes() -> int:
    """Peak resident set (VmHWM) of this process, 0 where /proc is missing. The peak never
    goes down: measure work in a fresh child process for a clean figure."""
    return _status("VmHWM")["VmHWM"]


def rss_parts() -> dict[str, int]:
    """The resident set now and what it is made of: VmRSS = RssAnon (heap, anonymous maps) +
    RssFile (mapped files, shared libraries) + RssShmem, in bytes; says which kind a figure out
    of line grew in."""
    return _status("VmRSS", "RssAnon", "RssFile", "RssShmem")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity), the default thread count of kernels."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
