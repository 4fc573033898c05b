"""Fixtures for aio tests: one handle per available backend, closed after the test."""

import pytest

import aio

BACKENDS = aio.available_backends()


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def handle(backend):
    with aio.Handle(block_size=64 << 10, queue_depth=8, threads=2, backend=backend) as h:
        yield h
