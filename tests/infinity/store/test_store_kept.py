"""Kept versions ([Note: kept versions] in infinity/store/_kept.py): keep holds an entry's bytes
as they were (on NVMe copy-on-write: no I/O, the next write-back to a fresh extent), commit lets
them go, rollback makes them the value again; after failed writes, when closed, when misused."""

import errno
import threading

import pytest
import torch

import aio
from infinity.errors import BudgetError, ClosedError
from infinity.store import TensorStore, Tier

KiB, MiB = 1 << 10, 1 << 20
N = 16 * KiB  # 64 KiB of float32


def _store(tmp_path, handle=None, **kw):
    budgets = {"host": kw.pop("host", MiB), "nvme": kw.pop("nvme", MiB)}
    return TensorStore({t: n for t, n in budgets.items() if n}, nvme_path=tmp_path,
                       aio_handle=handle, **kw)


def _change(store, key, value):
    with store.hold(key, dirty=True) as t:
        t.fill_(value)


def _read(store, key):
    """The value as its home has it (the host copy evicted first)."""
    if "host" in store.tiers_of(key) and store.home(key) != Tier.HOST:
        store.evict(key, "host")
    with store.hold(key) as t:
        return t.clone()


def _used(store, tier="nvme"):
    return store.stats()["tiers"][tier].used_nbytes


def _writes(store):
    return store.stats()["moves"].get("host->nvme", {"moves": 0})["moves"]


def test_on_nvme_keep_copies_nothing_and_the_write_back_goes_to_a_fresh_extent(tmp_path):
    with _store(tmp_path) as s:
        s.put("a", torch.full((N,), 1.0), "nvme")
        s.flush()
        before, writes = _used(s), _writes(s)
        s.keep("a")
        assert s.stats()["kept"] == {"entries": 1, "nbytes": 4 * N}  # "a", the one entry
        assert _writes(s) == writes and _used(s) == 2 * before  # the shadow extent, reserved
        _change(s, "a", 2.0)
        s.flush()
        assert _writes(s) == writes + 1  # one write-back, asynchronous as an unkept one
        assert torch.equal(_read(s, "a"), torch.full((N,), 2.0))
        s.commit("a")
        assert s.stats()["kept"] == {"entries": 0, "nbytes": 0}
        assert _used(s) == before
        assert torch.equal(_read(s, "a"), torch.full((N,), 2.0))


def test_a_rollback_brings_the_kept_bytes_back_without_io(tmp_path):
    with _store(tmp_path, checksum=True) as s:  # the kept extent's crc32c comes back with it
        s.put("a", torch.full((N,), 1.0), "nvme")
        before = _used(s)
        s.keep("a")
        _change(s, "a", 2.0)
        s.flush()
        moves = s.stats()["moves"]
        s.rollback("a")
        assert s.stats()["moves"] == moves and s.tiers_of("a") == ["nvme"]  # no I/O, host gone
        assert _used(s) == before and s.stats()["kept"]["entries"] == 0
        assert torch.equal(_read(s, "a"), torch.full((N,), 1.0))
        s.keep("a")  # kept again: the entry goes on as any other
        _change(s, "a", 3.0)
        s.commit("a")
        assert torch.equal(_read(s, "a"), torch.full((N,), 3.0))


def test_a_rollback_with_nothing_written_since_keep_frees_the_shadow(tmp_path):
    with _store(tmp_path) as s:
        s.put("a", torch.full((N,), 1.0), "nvme")
        before = _used(s)
        s.keep("a")
        with s.hold("a") as t:  # read, not changed
            assert torch.equal(t, torch.full((N,), 1.0))
        s.rollback("a")
        assert _used(s) == before and torch.equal(_read(s, "a"), torch.full((N,), 1.0))
        s.keep("a")
        s.commit("a")  # nothing written: the shadow goes, the extent stays the entry's
        assert _used(s) == before and torch.equal(_read(s, "a"), torch.full((N,), 1.0))


def test_every_write_back_after_keep_goes_to_the_fresh_extent_eviction_included(tmp_path):
    """Changed twice, the second write failing, then written down by an eviction: the kept
    extent is never written."""
    handle = aio.Handle(block_size=64 * KiB)
    with _store(tmp_path, handle, host=160 * KiB) as s:  # the host holds two of the three
        for key in "abc":
            s.put(key, torch.full((N,), 1.0), "nvme")
        s.keep("a")
        _change(s, "a", 2.0)
        s.flush()
        handle.inject(aio.Fault(op="write", nth=0, kind="errno", errno=errno.EIO))
        _change(s, "a", 3.0)
        with pytest.raises(aio.AIOError, match="EIO"):
            s.flush()
        for key in "bc":  # the host copy of "a" is evicted: written down first
            with s.hold(key):
                pass
        assert s.tiers_of("a") == ["nvme"] and not s.unsaved("a")
        assert torch.equal(_read(s, "a"), torch.full((N,), 3.0))
        s.rollback("a")
        assert torch.equal(_read(s, "a"), torch.full((N,), 1.0))
    handle.close()


def _kept_then_failed(s, handle):
    """"a" (1.0) kept, changed to 2.0, its write-back failing (flush raises it); returns the
    NVMe bytes used before keep."""
    s.put("a", torch.full((N,), 1.0), "nvme")
    before = _used(s)
    s.keep("a")
    handle.inject(aio.Fault(op="write", nth=0, kind="errno", errno=errno.EIO))
    _change(s, "a", 2.0)
    with pytest.raises(aio.AIOError, match="EIO"):
        s.flush()
    return before


def test_a_failed_write_back_leaves_the_kept_bytes_for_a_rollback(tmp_path):
    """The error surfaces (flush raises it); the kept extent was never written."""
    handle = aio.Handle(block_size=64 * KiB)
    with _store(tmp_path, handle) as s:
        before = _kept_then_failed(s, handle)
        assert s.unsaved("a")
        s.rollback("a")
        assert not s.unsaved("a") and _used(s) == before
        assert torch.equal(_read(s, "a"), torch.full((N,), 1.0))
    handle.close()


def test_a_commit_after_a_failed_write_back_keeps_the_new_value_unsaved(tmp_path):
    """As any failed write-back: the changed host copy stays, a dirty release writes it."""
    handle = aio.Handle(block_size=64 * KiB)
    with _store(tmp_path, handle) as s:
        _kept_then_failed(s, handle)
        s.commit("a")
        assert s.unsaved("a")
        with s.hold("a", dirty=True):
            pass
        s.flush()
        assert not s.unsaved("a") and torch.equal(_read(s, "a"), torch.full((N,), 2.0))
    handle.close()


def test_keep_after_a_failed_write_back_keeps_the_current_value(tmp_path):
    """The home copy is stale: keep raises the write-back's error, then writes the current
    value down before keeping it (a kept version is never a stale one)."""
    handle = aio.Handle(block_size=64 * KiB)
    with _store(tmp_path, handle) as s:
        s.put("a", torch.full((N,), 1.0), "nvme")
        handle.inject(aio.Fault(op="write", nth=0, kind="errno", errno=errno.EIO))
        _change(s, "a", 2.0)
        with pytest.raises(aio.AIOError, match="EIO"):
            s.keep("a")
        assert s.stats()["kept"]["entries"] == 0
        s.keep("a")
        assert not s.unsaved("a")
        _change(s, "a", 3.0)
        s.rollback("a")
        assert torch.equal(_read(s, "a"), torch.full((N,), 2.0))
    handle.close()


def test_at_home_in_memory_keep_copies_the_block(tmp_path):
    with _store(tmp_path, nvme=0) as s:
        s.put("a", torch.full((N,), 1.0), "host")
        before = _used(s, "host")
        s.keep("a")
        assert _used(s, "host") == 2 * before
        _change(s, "a", 2.0)
        s.rollback("a")
        assert _used(s, "host") == before and torch.equal(_read(s, "a"), torch.full((N,), 1.0))
        s.keep("a")
        _change(s, "a", 3.0)
        s.commit("a")
        assert _used(s, "host") == before and torch.equal(_read(s, "a"), torch.full((N,), 3.0))


def test_misuse_is_refused_and_changes_nothing(tmp_path):
    with _store(tmp_path) as s:
        s.put("a", torch.full((N,), 1.0), "nvme")
        with pytest.raises(KeyError, match="no tensor 'nope'"):
            s.keep("nope")
        for verb in (s.commit, s.rollback):
            with pytest.raises(ValueError, match="nothing is kept"):
                verb("a")
        s.keep("a")
        with pytest.raises(ValueError, match="kept already"):
            s.keep("a")
        with s.hold("a"):
            with pytest.raises(ValueError, match="in use or pinned on host"):
                s.rollback("a")
        _change(s, "a", 2.0)
        s.commit("a")
        with pytest.raises(ValueError, match="nothing is kept"):  # committed twice
            s.commit("a")
        with pytest.raises(ValueError, match="nothing is kept"):
            s.rollback("a")
        assert torch.equal(_read(s, "a"), torch.full((N,), 2.0))


def test_no_room_for_the_kept_bytes_keeps_nothing(tmp_path):
    with _store(tmp_path, nvme=96 * KiB) as s:  # one extent and no second
        s.put("a", torch.full((N,), 1.0), "nvme")
        with pytest.raises(BudgetError, match="nvme tier cannot hold 'a'"):
            s.keep("a")
        assert s.stats()["kept"] == {"entries": 0, "nbytes": 0}
    with _store(tmp_path, host=96 * KiB, nvme=0) as s:
        s.put("a", torch.full((N,), 1.0), "host")
        with pytest.raises(BudgetError, match="host tier cannot hold 'a'"):
            s.keep("a")
        assert s.stats()["kept"]["entries"] == 0 and _used(s, "host") == 64 * KiB


def test_drop_lets_the_kept_bytes_go_with_the_entry(tmp_path):
    with _store(tmp_path) as s:
        for written in (False, True):
            s.put("a", torch.full((N,), 1.0), "nvme")
            s.keep("a")
            if written:
                _change(s, "a", 2.0)
            s.drop("a")
            assert _used(s) == 0 and s.stats()["kept"]["entries"] == 0


def test_a_store_closed_while_an_entry_is_kept_refuses_to_decide_it(tmp_path):
    s = _store(tmp_path)
    s.put("a", torch.full((N,), 1.0), "nvme")
    s.keep("a")
    _change(s, "a", 2.0)
    s.close()  # frees the kept extent with the rest
    assert list(tmp_path.iterdir()) == []
    for verb in (s.commit, s.rollback, s.keep):
        with pytest.raises(ClosedError, match="closed"):
            verb("a")


def test_a_kept_block_counts_as_staying_when_a_tier_looks_for_room(tmp_path, in_thread):
    """Host budget of 3 blocks: "a" held here, its kept block, "b" held by another thread. A
    2-block request cannot fit even once "b" is released (the kept block stays): BudgetError
    at once, no wait for that release."""
    with _store(tmp_path, host=3 * 64 * KiB, room_wait_s=5) as s:
        for key in "ab":
            s.put(key, torch.full((N,), 1.0), "host")
        s.keep("a")
        s.evict("b", "host")  # to NVMe: the host tier holds "a" and its kept block
        held, done = threading.Event(), threading.Event()

        def hold_b():
            with s.hold("b"):
                held.set()
                done.wait(30)

        thread, outcome = in_thread(hold_b)
        assert held.wait(30)
        with s.hold("a"):
            with pytest.raises(BudgetError, match="host tier cannot hold 'wide'"):
                s.put("wide", torch.ones(2 * N), "host")
        done.set()
        thread.join(30)
        assert "error" not in outcome and s.stats()["room"]["waits"] == 0
        s.rollback("a")
