"""Shared test fixtures. Every test writes only under pytest's tmp_path."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    """Skip tests marked requires_cuda cleanly on machines without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)
