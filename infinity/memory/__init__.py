"""Preallocated memory: an arena that defragments itself, and the worker threads native kernels borrow."""

from infinity.memory.arena import Arena, ArenaStats, Block
from infinity.memory.thread_pool import ThreadPool

__all__ = [
    "Arena",
    "ArenaStats",
    "Block",
    "ThreadPool",
]
