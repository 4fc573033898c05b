"""The engine's fixed mmap threshold returns freed tensors to the OS where glibc's dynamic one
keeps them in a fragmented heap (infinity/memory/malloc.py); "auto" fixes it when something
lives on NVMe. Each case runs in a fresh child: malloc settings are per process."""

import json

import pytest
from children import python_child

from infinity.memory import set_mmap_threshold

CHILD = """
import json, sys, torch, infinity
from infinity.memory import rss_bytes
config = {"train_micro_batch_size_per_gpu": 1, **json.loads(sys.argv[1])}
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


def _released_mib(config: dict) -> float:
    out = python_child(["-c", CHILD, json.dumps(config)], timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1]) / (1 << 20)


def test_freed_tensors_go_back_to_the_os_under_the_engine(tmp_path):
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    for offload in ({"offload_param": nvme}, {"offload_optimizer": nvme}):  # "auto" with NVMe: 1 MiB
        assert _released_mib({"zero_optimization": {"stage": 3, **offload}}) >= 120  # 32 x 4 MiB freed
    assert _released_mib({"infinity": {"mmap_threshold": "1MiB"}}) >= 120
    # glibc's own threshold: they stay resident (the test can fail)
    assert _released_mib({"infinity": {"mmap_threshold": None}}) <= 16
    assert _released_mib({}) <= 16  # "auto", everything in RAM: malloc is left alone


def test_thresholds_out_of_range_are_refused():
    for bad in (0, -1, (32 << 20) + 1):
        with pytest.raises(ValueError, match="mmap threshold must be in"):
            set_mmap_threshold(bad)
