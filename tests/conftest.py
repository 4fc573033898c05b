"""Shared test fixtures. Every test writes only under pytest's tmp_path."""

import os
import shutil
import subprocess
import sys
import tempfile

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


@pytest.fixture
def read_only_dir():
    """A directory nobody may write into, under a parent everyone may traverse."""
    parent = tempfile.mkdtemp(prefix="infinity-test-")
    os.chmod(parent, 0o755)
    ro = os.path.join(parent, "ro")
    os.mkdir(ro)
    os.chmod(ro, 0o555)
    yield ro
    os.chmod(ro, 0o755)
    shutil.rmtree(parent)


@pytest.fixture
def run_unprivileged():
    """Run Python code in a child that drops root (root ignores file permissions).

    The code runs after `import aio, infinity`, since nobody may not read root's site-packages.
    """
    prologue = (
        "import os, sys, aio, infinity, infinity.store\n"
        "if os.geteuid() == 0:\n    os.setgid(65534); os.setuid(65534)\n"
    )

    def run(code: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", prologue + code], capture_output=True,
                              text=True, timeout=60)

    return run
