"""The engine's fixed mmap threshold returns freed tensors to the OS where glibc's dynamic one
keeps them in a fragmented heap (infinity/memory/malloc.py). Each case runs in a fresh child:
malloc settings are per process."""

import subprocess
import sys

import pytest

from infinity.memory import set_mmap_threshold

CHILD = """
import sys, torch, infinity
from infinity.memory import rss_bytes
config = {"train_micro_batch_size_per_gpu": 1}
if sys.argv[1] == "null":
    config["infinity"] = {"mmap_threshold": None}
engine = infinity.initialize(torch.nn.Linear(4, 4), config)
big = torch.ones(30 << 18)  # 30 MiB, mapped; freeing it raises glibc's dynamic threshold to 30 MiB
del big
kept, freed = [], []
for i in range(64):  # 4 MiB tensors, every other one freed: holes in the middle of the heap
    (kept if i % 2 else freed).append(torch.ones(1 << 20))
before = rss_bytes()
freed.clear()
print(before - rss_bytes())
engine.close()
"""


def _released_mib(how: str) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, how], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1]) / (1 << 20)


def test_freed_tensors_go_back_to_the_os_under_the_engine():
    assert _released_mib("default") >= 120  # 32 x 4 MiB freed
    assert _released_mib("null") <= 16  # glibc's own threshold: they stay resident (test can fail)


def test_thresholds_out_of_range_are_refused():
    for bad in (0, -1, (32 << 20) + 1):
        with pytest.raises(ValueError, match="mmap threshold must be in"):
            set_mmap_threshold(bad)
