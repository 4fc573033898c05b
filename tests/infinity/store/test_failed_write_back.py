"""After a failed write-back the store keeps the changed copy: evicting it writes it down first."""

import errno

import pytest
import torch

import aio
from infinity.store import TensorStore

KiB = 1 << 10


def test_a_copy_whose_write_back_failed_is_written_down_before_eviction(tmp_path):
    handle = aio.Handle(block_size=64 * KiB)
    with TensorStore({"host": 64 * KiB, "nvme": 1 << 20}, nvme_path=tmp_path,
                     aio_handle=handle) as store:
        store.put("a", torch.zeros(8 * KiB), "nvme")  # 32 KiB: the host holds two such
        store.put("b", torch.zeros(8 * KiB), "nvme")
        store.put("c", torch.zeros(8 * KiB), "nvme")
        store.fetch("a", "host").result().fill_(7.0)
        handle.inject(aio.Fault(op="write", nth=0, kind="errno", errno=errno.EIO))
        store.release("a", "host", dirty=True)
        with pytest.raises(aio.AIOError, match="EIO"):
            store.flush()
        assert store.tiers_of("a") == ["host"]  # the NVMe copy is stale, the host copy current
        assert store.unsaved("a") and not store.unsaved("b")
        for key in ("b", "c"):  # fill the host tier: "a" must be evicted
            store.fetch(key, "host").result()
            store.release(key, "host")
        assert store.tiers_of("a") == ["nvme"] and not store.unsaved("a")
        assert torch.equal(store.fetch("a", "host").result(), torch.full((8 * KiB,), 7.0))
        store.release("a", "host")
    handle.close()


def test_a_failed_write_back_is_retried_by_fetch_and_dirty_release(tmp_path):
    handle = aio.Handle(block_size=64 * KiB)
    with TensorStore({"host": 64 * KiB, "nvme": 1 << 20}, nvme_path=tmp_path,
                     aio_handle=handle) as store:
        store.put("a", torch.zeros(1000), "nvme")
        store.fetch("a", "host").result().fill_(3.0)
        handle.inject(aio.Fault(op="write", nth=0, kind="errno", errno=errno.EIO))
        store.release("a", "host", dirty=True)
        with pytest.raises(aio.AIOError):
            store.flush()
        assert store.unsaved("a")
        store.fetch("a", "host").result()
        store.release("a", "host", dirty=True)
        store.flush()
        assert not store.unsaved("a")
        store.evict("a", "host")
        assert torch.equal(store.fetch("a", "host").result(), torch.full((1000,), 3.0))
        store.release("a", "host")
    handle.close()
