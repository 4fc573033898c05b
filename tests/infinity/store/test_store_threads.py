"""TensorStore under threads: no I/O wait under the lock, and close() racing everything else."""

import contextlib
import errno
import random
import sys
import threading
import time

import pytest
import torch

import aio
from infinity.errors import BudgetError, ClosedError, WouldWait
from infinity.store import TensorStore

MiB = 1 << 20


def _until(condition, timeout=60.0):
    """Poll `condition` until it holds (an event the code under test does not signal)."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.005)


def _waiting(thread) -> bool:
    """Whether `thread` is inside a wait call (for I/O or for room), by its Python stack."""
    frame = sys._current_frames().get(thread.ident)
    while frame is not None and frame.f_code.co_name != "wait":
        frame = frame.f_back
    return frame is not None


def _store_holding_w(tmp_path):
    """A store (host 1 MiB) with "r" (100 KB) pinned on host and "w" (400 KB) fetched to host
    and filled with 3.0, its handle set to hang the next write; returns (handle, store): the
    caller releases w and closes both."""
    handle = aio.Handle()
    store = TensorStore({"host": MiB, "nvme": 8 * MiB}, nvme_path=tmp_path, aio_handle=handle)
    store.put("r", torch.arange(25_000.0), "nvme")  # 100 KB, kept resident on host
    store.pin("r", "host")
    store.put("w", torch.zeros(100_000), "nvme")  # 400 KB
    store.fetch("w", "host").result(timeout=30).fill_(3.0)
    handle.inject(aio.Fault(op="write", nth=0, kind="hang"))
    return handle, store


@pytest.mark.parametrize("blocker", ["flush", "eviction", "put"])
def test_a_thread_waiting_for_a_hung_write_does_not_block_another_threads_fetch(tmp_path, blocker,
                                                                                in_thread):
    handle, store = _store_holding_w(tmp_path)
    try:
        if blocker == "put":
            store.release("w", "host")
            thread, outcome = in_thread(lambda: store.put("p", torch.ones(1000), "nvme"))
        else:
            store.release("w", "host", dirty=True)  # its write-back hangs
            if blocker == "flush":
                thread, outcome = in_thread(store.flush)
            else:  # 600 KB more on the host: only w can make room, once its write-back is done
                store.put("big", torch.ones(150_000), "nvme")
                thread, outcome = in_thread(lambda: store.fetch("big", "host").result(timeout=60))
        _until(lambda: _waiting(thread) or not thread.is_alive())
        assert thread.is_alive(), outcome  # it is waiting for the hung write

        def fetch_resident():
            t = store.fetch("r", "host").result(timeout=10)
            assert torch.equal(t, torch.arange(25_000.0))
            store.release("r", "host")
            return store.tiers_of("w"), store.stats()["tiers"]["host"].copies

        reader, read = in_thread(fetch_resident)
        reader.join(timeout=10)
        stalled = reader.is_alive()
        handle.close()  # cancels the hung write: the blocked thread gets ECANCELED
        thread.join(timeout=30)
        reader.join(timeout=30)
        assert not stalled, "a fetch of a resident key waited for another thread's I/O"
        assert "error" not in read, read
        assert not thread.is_alive()
        assert (isinstance(outcome.get("error"), aio.AIOError)
                and outcome["error"].errno == errno.ECANCELED), outcome
    finally:
        handle.close()
        store.close()  # the failed write was raised to the waiting thread: nothing left to raise


def test_close_raises_the_first_failed_write_back_after_freeing_everything(tmp_path, caplog):
    handle = aio.Handle()
    store = TensorStore({"host": MiB, "nvme": 8 * MiB}, nvme_path=tmp_path, aio_handle=handle)
    for key in ("a", "b", "c"):
        store.put(key, torch.zeros(1000), "nvme")
        store.fetch(key, "host").result(timeout=30).fill_(1.0)
    handle.inject(aio.Fault(op="write", nth=0, kind="errno", errno=errno.EIO))
    handle.inject(aio.Fault(op="write", nth=1, kind="errno", errno=errno.ENOSPC))
    for key in ("a", "b", "c"):
        store.release(key, "host", dirty=True)  # three write-backs: two fail
    with pytest.raises(aio.AIOError, match="EIO|ENOSPC") as failure:
        store.close()
    assert any("'a'" in note or "'b'" in note for note in failure.value.__notes__)  # names the key
    assert "at close" in caplog.text  # the second failure is logged
    assert list(tmp_path.iterdir()) == []  # the swap file is gone all the same
    assert store.stats()["tiers"]["host"].copies == 0
    with pytest.raises(ClosedError, match="closed"):  # a ValueError, as before
        store.fetch("a", "host")
    store.close()  # closing again is a no-op
    handle.close()


def test_close_with_a_failed_read_in_flight_raises_it(tmp_path):
    handle = aio.Handle()
    store = TensorStore({"host": MiB, "nvme": 8 * MiB}, nvme_path=tmp_path, aio_handle=handle)
    store.put("x", torch.ones(1000), "nvme")
    handle.inject(aio.Fault(op="read", nth=0, kind="errno", errno=errno.EIO))
    assert store.prefetch(["x"], "host") == ["x"]
    with pytest.raises(aio.AIOError, match="EIO"):
        store.close()
    handle.close()


@pytest.mark.parametrize("checksum", [False, True])
def test_close_racing_fetches_and_write_backs_never_crashes_nor_hangs(tmp_path, checksum,
                                                                      in_thread):
    store = TensorStore({"device": MiB, "host": 2 * MiB, "nvme": 32 * MiB}, nvme_path=tmp_path,
                        device="cpu",
                        aio_options={"block_size": 64 << 10}, checksum=checksum,
                        room_wait_s=600)  # a thread waiting for room must be woken by close()
    keys = [f"k{i}" for i in range(16)]
    for key in keys:
        store.put(key, torch.full((40_000,), 1.0), "nvme")
    started = threading.Barrier(5)
    calls = [0] * 4
    tries = [0] * 4

    def worker(seed):
        rng = random.Random(seed)
        started.wait()
        while True:
            tries[seed] += 1
            key = rng.choice(keys)
            tier = rng.choice(["host", "device"])
            try:
                action = rng.random()
                if action < 0.1:
                    store.prefetch(rng.sample(keys, 3), tier)
                elif action < 0.15:
                    store.flush()
                else:
                    t = store.fetch(key, tier).result(timeout=30)
                    try:
                        t.add_(0)
                    finally:
                        store.release(key, tier, dirty=action < 0.6)
                calls[seed] += 1
            except BudgetError:
                continue  # every copy in use by the other threads at this instant
            except ValueError as exc:
                if "closed" in str(exc):
                    return
                if "in use" not in str(exc):  # two threads modifying one key: refused clearly
                    raise

    threads = [in_thread(lambda s=s: worker(s)) for s in range(4)]
    started.wait()
    # every thread inside its loop and 80 calls done in all, not a share each: a thread waiting
    # for room has no place in line, so another may take that room again and again (see _tiers)
    _until(lambda: (min(tries) >= 1 and sum(calls) >= 80)
           or not all(t.is_alive() for t, _ in threads))
    closer, closed = in_thread(store.close)
    closer.join(timeout=60)
    for thread, _ in threads:
        thread.join(timeout=60)
    assert not closer.is_alive() and not any(t.is_alive() for t, _ in threads), "a thread hung"
    assert closed == {"value": None}, closed
    for _, outcome in threads:
        assert "error" not in outcome, outcome["error"]
    assert sum(calls) > 0
    assert list(tmp_path.iterdir()) == []


def test_a_fetch_that_may_not_wait_is_refused_where_room_waits_for_a_write_back(tmp_path,
                                                                               in_thread):
    """fetch(wait=False), a read ahead on a computing thread: where the only way to room is a
    copy whose write-back is still running, WouldWait at once, nothing evicted or fetched (with
    wait=True the same fetch waits for the write: the eviction test above)."""
    handle, store = _store_holding_w(tmp_path)
    try:
        store.release("w", "host", dirty=True)  # its write-back hangs
        store.put("big", torch.ones(150_000), "nvme")  # 600 KB: room only where w is
        thread, outcome = in_thread(lambda: store.fetch("big", "host", wait=False))
        thread.join(10)
        assert not thread.is_alive(), "fetch(wait=False) waited for the hung write-back"
        assert isinstance(outcome.get("error"), WouldWait), outcome
        assert "'big'" in str(outcome["error"]) and "host" in str(outcome["error"])
        assert store.tiers_of("big") == ["nvme"]
        assert "host" in store.tiers_of("w")  # not evicted: its write is still running
    finally:
        handle.close()  # cancels the hung write
        with contextlib.suppress(aio.AIOError):
            store.close()


def test_a_fetch_that_may_not_wait_is_refused_where_room_waits_for_another_threads_release(
        tmp_path, in_thread):
    """The other wait for room, another thread's release: WouldWait too, without waiting; the
    same fetch with wait=True gets the room once the copy is released."""
    with TensorStore({"host": MiB, "nvme": 8 * MiB}, nvme_path=tmp_path) as store:
        store.put("held", torch.ones(150_000), "nvme")  # 600 KB
        store.put("big", torch.full((150_000,), 2.0), "nvme")
        holding, may_release = threading.Event(), threading.Event()

        def worker():
            store.fetch("held", "host").result(timeout=30)
            holding.set()
            may_release.wait(30)
            store.release("held", "host")

        thread, outcome = in_thread(worker)
        assert holding.wait(30)
        refused, refusal = in_thread(lambda: store.fetch("big", "host", wait=False))
        refused.join(10)
        assert not refused.is_alive(), "fetch(wait=False) waited for another thread's release"
        assert isinstance(refusal.get("error"), WouldWait), refusal
        assert "another thread's release" in str(refusal["error"])
        assert store.tiers_of("big") == ["nvme"]
        may_release.set()
        thread.join(30)
        assert "error" not in outcome, outcome
        assert torch.all(store.fetch("big", "host", wait=False).result(timeout=30) == 2.0)
        store.release("big", "host")


def test_a_fetch_that_only_reads_is_handed_out_while_its_write_back_runs(tmp_path, in_thread):
    """fetch(reads_only=True) (the coordinator's, for forward and backward): a copy whose
    write-back to NVMe is still running is handed out at once, with its new bytes; a fetch that
    may write waits for the write first (its bytes are being read out)."""
    handle, store = _store_holding_w(tmp_path)
    try:
        store.release("w", "host", dirty=True)  # its write-back hangs
        reader, read = in_thread(lambda: store.fetch("w", "host", reads_only=True).result())
        reader.join(10)
        assert not reader.is_alive(), "a fetch that only reads waited for the write-back"
        assert torch.all(read["value"] == 3.0), read
        assert store.fetch("w", "host", reads_only=True).done()
        store.release("w", "host")
        store.release("w", "host")
        writer, _ = in_thread(lambda: store.fetch("w", "host").result())
        writer.join(1)
        assert writer.is_alive(), "a fetch that may write did not wait for the write-back"
    finally:
        handle.close()  # cancels the hung write: the waiting fetch gets ECANCELED
        with contextlib.suppress(aio.AIOError):
            store.close()
