"""A copy's bytes follow [Note: a copy's lifecycle]: a fill is the current value only once it has
landed, a wrong transition is refused by name, and `hold` releases on every path."""

import errno

import pytest
import torch

import aio
from infinity.store import TensorStore, Tier
from infinity.store._entry import Copy, CopyState

KiB = 1 << 10


def _store(tmp_path, handle):
    return TensorStore({"host": 64 * KiB, "nvme": 1 << 20}, nvme_path=tmp_path, aio_handle=handle)


def _in_use(store):
    return sorted(k for k, e in store._copies.entries.items() for c in e.copies.values() if c.uses)


def test_a_wrong_transition_is_a_named_bug():
    copy = Copy(Tier.HOST)
    with pytest.raises(RuntimeError, match="host copy is empty, expected valid"):
        copy.start_draining(object())
    copy.filled()
    with pytest.raises(RuntimeError, match="host copy is valid, expected empty"):
        copy.filled()
    with pytest.raises(RuntimeError, match="does not touch the host copy"):
        copy.settle(object(), landed=True)
    copy.outdate()
    assert copy.state is CopyState.EMPTY and not copy.current


def test_a_read_in_flight_is_filling_and_valid_only_once_settled(tmp_path):
    handle = aio.Handle(block_size=64 * KiB)
    store = _store(tmp_path, handle)
    store.put("a", torch.arange(1000.0), "nvme")
    handle.inject(aio.Fault(op="read", nth=0, kind="hang"))
    future = store.fetch("a", "host")
    host = store._copies.entries["a"].copies[Tier.HOST]
    assert host.state is CopyState.FILLING and not future.done()
    assert store.tiers_of("a") == ["host", "nvme"]  # on its way: counted as current
    with pytest.raises(aio.AIOTimeoutError):
        future.result(timeout=0.1)
    assert host.state is CopyState.FILLING  # never handed out before its bytes land
    handle.close()  # cancels the hung read: it settles EMPTY, and close() reports it
    with pytest.raises(aio.AIOError) as info:
        store.close()
    assert info.value.errno == errno.ECANCELED and host.state is CopyState.EMPTY


def test_a_dirty_release_after_a_failed_read_is_refused_and_loses_nothing(tmp_path):
    handle = aio.Handle(block_size=64 * KiB)
    with _store(tmp_path, handle) as store:
        store.put("a", torch.arange(1000.0), "nvme")
        handle.inject(aio.Fault(op="read", nth=0, kind="errno", errno=errno.EIO))
        future = store.fetch("a", "host")
        with pytest.raises(aio.AIOError, match="EIO"):
            future.result(timeout=30)
        with pytest.raises(ValueError, match="its bytes never arrived"):
            store.release("a", "host", dirty=True)
        assert _in_use(store) == [] and store.tiers_of("a") == ["nvme"] and not store.unsaved("a")
        with store.hold("a") as tensor:
            assert torch.equal(tensor, torch.arange(1000.0))
    handle.close()


def test_hold_releases_on_every_path_and_dirty_only_what_it_handed_out(tmp_path):
    handle = aio.Handle(block_size=64 * KiB)
    with _store(tmp_path, handle) as store:
        store.put("a", torch.zeros(1000), "nvme")
        with store.hold("a", dirty=True) as tensor:  # a clean end: written back
            tensor.fill_(1.0)
        store.flush()
        store.evict("a", "host")
        with pytest.raises(KeyError, match="boom"), store.hold("a", dirty=True) as tensor:
            tensor[:10] = 2.0  # changed part-way, then the block fails: still written back
            raise KeyError("boom")
        store.flush()
        store.evict("a", "host")
        with store.hold("a") as tensor:
            assert tensor[:10].eq(2.0).all() and tensor[10:].eq(1.0).all()
        handle.inject(aio.Fault(op="read", nth=0, kind="errno", errno=errno.EIO))
        store.evict("a", "host")
        with pytest.raises(aio.AIOError, match="EIO"), store.hold("a", dirty=True):
            pytest.fail("a block whose read failed does not run")
        assert _in_use(store) == [] and store.tiers_of("a") == ["nvme"]  # released clean
        with pytest.raises(KeyError, match="no tensor 'b'"), store.hold("b"):
            pass
        assert _in_use(store) == []
    handle.close()
