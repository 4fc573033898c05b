"""Transparent huge pages for torch's large CPU tensors ([Note: huge pages], infinity/__init__.py):
importing infinity before the first CPU allocation turns them on unless the environment chose;
the kernel then backs a large tensor with 2 MiB pages where its THP mode allows."""

import os
import sys

import pytest
from children import python_child

ALLOCATE = r"""
import sys
if sys.argv[1] == "infinity-first":
    import infinity
import torch
import os

def huge_kib():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])

before = huge_kib()
tensors = [torch.ones(8 << 20, dtype=torch.uint8) for _ in range(8)]  # 64 MiB, touched
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), huge_kib() - before)
"""


def thp_mode() -> str | None:
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return None
    return text.split("[")[1].split("]")[0]


def allocate(order: str, **env: str) -> tuple[str, int]:
    environment = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    done = python_child(["-c", ALLOCATE, order], env={**environment, **env}, timeout=300)
    assert done.returncode == 0, done.stderr
    setting, kib = done.stdout.split()
    return setting, int(kib)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="smaps is Linux's")
def test_infinity_imported_first_backs_large_tensors_with_huge_pages():
    setting, kib = allocate("infinity-first")
    assert setting == "1"
    mode = thp_mode()
    if mode in ("madvise", "always"):
        assert kib >= 32 << 10  # most of the 64 MiB in 2 MiB pages
    setting, kib = allocate("torch-only")  # torch alone leaves them off
    assert setting == "None"
    if mode == "madvise":  # only what asked for them gets them: the measure tells
        assert kib < 8 << 10


def test_the_environment_is_left_alone():
    setting, kib = allocate("infinity-first", THP_MEM_ALLOC_ENABLE="0")
    assert setting == "0"
    if thp_mode() == "madvise":
        assert kib < 8 << 10
