"""Preallocated memory: an arena that defragments itself, and a pool of I/O staging buffers."""

from infinity.memory.arena import Arena, ArenaStats, Block
from infinity.memory.buffer_pool import (
    BufferPool,
    BufferPoolStats,
    Chunk,
    PooledBuffer,
    iter_chunks,
)
from infinity.memory.thread_pool import ThreadPool

__all__ = [
    "Arena",
    "ArenaStats",
    "Block",
    "BufferPool",
    "BufferPoolStats",
    "Chunk",
    "PooledBuffer",
    "ThreadPool",
    "iter_chunks",
]
