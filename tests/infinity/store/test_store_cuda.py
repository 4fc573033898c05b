"""TensorStore's device tier on a real GPU: host <-> device copies on a real CUDA side stream,
staged through pinned host memory to and from the NVMe tier.

test_tensor_store.py runs the same paths on the CPU with a stand-in stream; this file is what
a CUDA machine runs. The last two tests hold the store to the caller's stream: work queued on
it before release() must be seen by the write-back, and must be done with a block before the
store refills it. torch.cuda._sleep keeps the caller's stream busy so a missing wait shows.
"""

import random

import pytest
import torch

from infinity.store import TensorStore

pytestmark = pytest.mark.requires_cuda

MiB = 1 << 20
GPU_SLEEP_CYCLES = 200_000_000  # ~0.1 s of a GPU's time: far longer than any copy below


def _tensors(n: int, seed: int, max_numel: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16, torch.int64])
        numel = rng.randrange(1, max_numel)
        out[f"t{i}"] = (torch.randint(-1000, 1000, (numel,), generator=gen) if dtype == torch.int64
                        else torch.randn(numel, generator=gen).to(dtype))
    return out


def _store(tmp_path, device_nbytes: int, host_nbytes: int) -> TensorStore:
    return TensorStore({"device": device_nbytes, "host": host_nbytes, "nvme": 256 * MiB},
                       nvme_path=tmp_path, device="cuda",
                       aio_options={"block_size": 256 << 10, "queue_depth": 8})


def test_device_tier_uses_cuda_memory_and_pinned_host(tmp_path):
    with _store(tmp_path, MiB, 2 * MiB) as store:
        assert store.device.type == "cuda"
        store.put("x", torch.arange(1000.0), "nvme")
        t = store.fetch("x", "device").result(timeout=30)
        assert t.is_cuda and torch.equal(t.cpu(), torch.arange(1000.0))
        store.release("x", "device")
        h = store.fetch("x", "host").result(timeout=30)
        assert h.device.type == "cpu" and h.is_pinned()
        store.release("x", "host")


def test_round_trip_across_device_host_and_nvme(tmp_path):
    """Random fetches to device and host under budgets far smaller than the data, with
    modifications on the device written back through host to NVMe."""
    data = _tensors(30, seed=21, max_numel=100_000)
    homes = ["nvme", "host", "device"]
    with _store(tmp_path, MiB, 2 * MiB) as store:
        for i, (key, t) in enumerate(data.items()):
            home = homes[i % 3] if t.numel() * t.element_size() < 256 << 10 else "nvme"
            store.put(key, t.cuda() if i % 2 else t, home)  # from device and from host memory
        rng = random.Random(21)
        for step in range(200):
            key = rng.choice(list(data))
            tier = rng.choice(["device", "device", "host"])
            t = store.fetch(key, tier).result(timeout=30)
            assert t.is_cuda == (tier == "device")
            assert torch.equal(t.cpu(), data[key]), (step, key, tier)
            modify = tier == "device" and rng.random() < 0.4
            if modify:
                t.add_(1) if t.dtype != torch.int64 else t.add_(2)  # on the current stream
                data[key] = t.to("cpu", copy=True)
            store.release(key, tier, dirty=modify)
            if rng.random() < 0.2 and "host" in store.tiers_of(key):
                store.evict(key, "host")  # the write-back then goes device -> host -> nvme
        store.flush()
        for key in data:  # home copies move down: every key is then read from NVMe
            store.evict(key, "device")
            store.evict(key, "host")
        assert all(store.tiers_of(key) == ["nvme"] for key in data)
        for key, t in data.items():
            assert torch.equal(store.fetch(key, "host").result(timeout=30), t), key
            store.release(key, "host")
        moves = store.stats()["moves"]
        for direction in ("nvme->host", "host->device", "device->host", "host->nvme"):
            assert moves[direction]["nbytes"] > 0, direction


def test_write_back_sees_work_queued_on_the_callers_stream(tmp_path):
    """release(dirty=True) right after an in-place kernel (an optimizer step on the device):
    the side-stream copy down must wait for that kernel."""
    n = 4 * MiB // 4
    with _store(tmp_path, 8 * MiB, 8 * MiB) as store:
        store.put("w", torch.zeros(n), "nvme")
        t = store.fetch("w", "device").result(timeout=30)
        torch.cuda._sleep(GPU_SLEEP_CYCLES)
        t.fill_(1.0)  # queued behind the sleep on the current stream
        store.release("w", "device", dirty=True)
        store.flush()
        store.evict("w", "device")
        store.evict("w", "host")
        got = store.fetch("w", "host").result(timeout=30)
        assert torch.equal(got, torch.ones(n)), (
            f"{int((got != 1).sum())} elements written back stale")
        store.release("w", "host")


def test_released_block_is_not_refilled_under_queued_reads(tmp_path):
    """A kernel queued on the caller's stream still reads a fetched tensor after release()
    (forward releases a layer as soon as its kernels are queued); the store must not copy the
    next tensor into that memory before the kernel has run."""
    n = 4 * MiB // 4
    a, b = torch.full((n,), 1.0), torch.full((n,), 2.0)
    with _store(tmp_path, 4 * MiB, 16 * MiB) as store:  # the device tier holds one of them
        store.put("a", a, "host")
        store.put("b", b, "host")
        ta = store.fetch("a", "device").result(timeout=30)
        torch.cuda._sleep(GPU_SLEEP_CYCLES)
        out = ta * 1  # reads a's block once the sleep is over
        store.release("a", "device")
        tb = store.fetch("b", "device").result(timeout=30)  # evicts a, reuses its block
        assert tb.data_ptr() == ta.data_ptr(), "the test needs b to land where a was"
        assert torch.equal(out.cpu(), a), "a kernel queued before release read the next tensor"
        assert torch.equal(tb.cpu(), b)
        store.release("b", "device")
