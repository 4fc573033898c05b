"""Preallocated memory: an arena that defragments itself, and the worker threads native
kernels borrow."""

from infinity.memory.arena import Arena, ArenaStats, Block
from infinity.memory.malloc import MAX_MMAP_THRESHOLD, set_mmap_threshold
from infinity.memory.thread_pool import ThreadPool
from infinity.memory.usage import peak_rss_bytes, rss_bytes, rss_parts, usable_cores

__all__ = [
    "MAX_MMAP_THRESHOLD",
    "Arena",
    "ArenaStats",
    "Block",
    "ThreadPool",
    "peak_rss_bytes",
    "rss_bytes",
    "rss_parts",
    "set_mmap_threshold",
    "usable_cores",
]
