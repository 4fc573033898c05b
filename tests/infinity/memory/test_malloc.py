"""The engine's fixed mmap threshold returns freed tensors to the OS where glibc's dynamic one
keeps them in a fragmented heap (infinity/memory/malloc.py); "auto" fixes it when something
lives on NVMe (8 MiB, 32 MiB where the model computes in fp32). Each case runs in a fresh
child: malloc settings are per process."""

import json

import pytest
from children import python_child

from infinity.memory import set_mmap_threshold

CHILD = """
import json, os, sys, torch, infinity
from infinity.memory import rss_bytes

def released(numel, config):
    engine = infinity.initialize(torch.nn.Linear(4, 4),
                                 {"train_micro_batch_size_per_gpu": 1, **config})
    big = torch.ones(30 << 18)  # 30 MiB, mapped; freeing it raises glibc's dynamic threshold
    del big
    kept, freed = [], []
    for i in range(32):  # every other one freed: holes in the middle of the heap
        (kept if i % 2 else freed).append(torch.ones(numel))
    before = rss_bytes()
    freed.clear()
    released = before - rss_bytes()
    engine.close()
    return released

# One import, then a fork per case: each case starts from malloc's settings as a new process has
# them (nothing here set a threshold or freed a large block before forking).
numel = int(sys.argv[1])
for config in map(json.loads, sys.argv[2:]):
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            print(released(numel, config), flush=True)
        except BaseException:
            import traceback; traceback.print_exc()
            code = 3
        os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0, config
"""


def _released_mib(mib: int, *configs: dict) -> list[float]:
    """MiB returned to the OS when 16 of 32 live float32 tensors of `mib` MiB are freed, per
    config."""
    out = python_child(["-c", CHILD, str(mib << 18), *map(json.dumps, configs)], timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return [int(line) / (1 << 20) for line in out.stdout.split()]


BF16_COMPUTE = {"bf16": {"enabled": True}, "infinity": {"compute_dtype": "bf16"}}


def test_freed_tensors_go_back_to_the_os_under_the_engine(tmp_path):
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    released = _released_mib(  # "auto" with NVMe and 16-bit compute: 8 MiB
        16, {"zero_optimization": {"stage": 3, "offload_param": nvme}, **BF16_COMPUTE},
        {"zero_optimization": {"stage": 3, "offload_optimizer": nvme}, **BF16_COMPUTE},
        {"infinity": {"mmap_threshold": "1MiB"}},
        {"infinity": {"mmap_threshold": None}},  # glibc's own threshold: they stay resident
        {})  # "auto", everything in RAM: malloc is left alone
    assert len(released) == 5
    assert all(mib >= 240 for mib in released[:3]), released  # 16 x 16 MiB freed
    assert all(mib <= 32 for mib in released[3:]), released  # (the test can fail)


def test_with_nvme_tensors_below_8_mib_reuse_the_heap(tmp_path):
    """"auto" with NVMe is 8 MiB at the least, not 1 MiB: the step's 1-2 MiB activations are
    served again from the heap instead of being mapped and faulted in afresh each time
    (docs/performance.md "The mmap threshold at 8 MiB, with huge pages")."""
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    auto, one_mib = _released_mib(2, {"zero_optimization": {"stage": 3, "offload_param": nvme},
                                      **BF16_COMPUTE},
                                  {"infinity": {"mmap_threshold": "1MiB"}})
    assert auto <= 8, (auto, one_mib)  # the 16 x 2 MiB freed stay in the heap for reuse
    assert one_mib >= 24, (auto, one_mib)  # at 1 MiB they go back to the OS (the test can fail)


def test_with_nvme_and_fp32_compute_tensors_below_32_mib_reuse_the_heap(tmp_path):
    """A model that computes in fp32 gets glibc's ceiling, 32 MiB: its upcast parameters and
    weight gradients (16 MiB on the 294M GPT) are served again from the heap instead of being
    mapped and their huge pages zeroed afresh each step (docs/performance.md "The mmap
    threshold at 32 MiB where the model computes in fp32")."""
    nvme = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme",
                                                                "nvme_path": str(tmp_path)}}}
    fp32, bf16_storage, bf16 = _released_mib(
        16, nvme, {**nvme, "bf16": {"enabled": True}, "infinity": {"compute_dtype": "fp32"}},
        {**nvme, **BF16_COMPUTE})
    assert fp32 <= 32 and bf16_storage <= 32, (fp32, bf16_storage)  # kept for reuse
    assert bf16 >= 240, bf16  # at 8 MiB they go back to the OS (the test can fail)


def test_thresholds_out_of_range_are_refused():
    for bad in (0, -1, (32 << 20) + 1):
        with pytest.raises(ValueError, match="mmap threshold must be in"):
            set_mmap_threshold(bad)
