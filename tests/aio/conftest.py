"""Fixtures for aio tests: one handle per backend, closed after the test."""

import os

import pytest

import aio
from aio._native import probe
from aio.handle import BACKENDS


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """Each backend; skipped, saying why, where this process cannot use it."""
    ret = probe(request.param)
    if ret != 0:
        pytest.skip(f"{request.param} unavailable here ({os.strerror(-ret)})")
    return request.param


@pytest.fixture
def handle(backend):
    with aio.Handle(block_size=64 << 10, queue_depth=8, threads=2, backend=backend) as h:
        yield h
