"""TensorStore: every tier path under tight budgets, eviction, concurrency, errors, counters."""

import errno
import json
import os
import random
import textwrap
import threading

import pytest
import torch

import aio
from infinity.errors import BudgetError
from infinity.store import TensorStore, Tier
from infinity.store._copies import Copies

MiB = 1 << 20


def _tensors(n, seed=0, max_numel=300_000):
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    out = {}
    for i in range(n):
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16, torch.int64])
        numel = rng.randrange(1, max_numel)
        out[f"t{i}"] = torch.randn(numel, generator=g).to(dtype) if dtype != torch.int64 else \
            torch.randint(-1000, 1000, (numel,), generator=g)
    return out


def _assert_holds(store, data, tier="host"):
    """Every key reads back equal to its expected tensor (and is released again)."""
    for key, t in data.items():
        assert torch.equal(store.fetch(key, tier).result(timeout=30), t), key
        store.release(key, tier)


@pytest.fixture
def store(tmp_path):
    with TensorStore({"device": 1 * MiB, "host": 2 * MiB, "nvme": 64 * MiB}, nvme_path=tmp_path,
                     device="cpu", aio_options={"block_size": 256 << 10, "queue_depth": 8}) as s:
        yield s


def test_every_tier_path_under_budgets_ten_times_smaller_than_the_data(store):
    data = _tensors(100, seed=1, max_numel=120_000)
    total = sum(t.numel() * t.element_size() for t in data.values())
    assert total > 10 * 2 * MiB  # the host budget is over 10x smaller than the data
    for key, t in data.items():
        store.put(key, t, "nvme")
    rng = random.Random(2)
    for step in range(300):
        key = rng.choice(list(data))
        tier = rng.choice(["host", "device"])
        t = store.fetch(key, tier).result(timeout=30)
        assert torch.equal(t, data[key]), (step, key, tier)
        modify = rng.random() < 0.3
        if modify:
            t.add_(1) if t.dtype != torch.int64 else t.add_(3)
            data[key] = t.clone()
        store.release(key, tier, dirty=modify)
    store.flush()
    for key in data:  # everything written back and still right
        store.evict(key, "device")
        store.evict(key, "host")
        assert store.tiers_of(key) == ["nvme"]
    _assert_holds(store, data)
    moves = store.stats()["moves"]
    assert moves["nvme->host"]["moves"] > 0 and moves["host->nvme"]["moves"] > 0
    assert moves["host->device"]["moves"] > 0


def test_host_home_moves_down_to_nvme_when_full_and_comes_back(store):
    data = _tensors(12, seed=3, max_numel=120_000)
    for key, t in data.items():
        store.put(key, t, "host")  # more than the host budget: older ones move down
    assert any(store.tiers_of(k) == ["nvme"] for k in data)
    _assert_holds(store, data)


def test_next_use_hints_pick_the_victim(tmp_path):
    with TensorStore({"host": 1 * MiB, "nvme": 16 * MiB}, nvme_path=tmp_path) as s:
        for i in range(3):
            s.put(f"k{i}", torch.full((60_000,), float(i)), "nvme")  # 240 KB each
            s.fetch(f"k{i}", "host").result()
            s.release(f"k{i}", "host")
        s.set_next_use({"k0": 1, "k1": 100, "k2": 2})
        s.put("big", torch.zeros(100_000), "nvme")
        s.fetch("big", "host").result()  # needs room: k1 is needed last, so it goes
        assert s.tiers_of("k1") == ["nvme"]
        assert "host" in s.tiers_of("k0") and "host" in s.tiers_of("k2")
        s.release("big", "host")


def test_fragmented_host_tier_compacts_and_keeps_contents(tmp_path):
    with TensorStore({"host": 1 * MiB, "nvme": 16 * MiB}, nvme_path=tmp_path) as s:
        small = {f"s{i}": torch.full((30_000,), float(i)) for i in range(8)}  # 120 KB each
        for key, t in small.items():
            s.put(key, t, "host")
        for i in range(0, 8, 2):
            s.drop(f"s{i}")  # holes of 120 KB between live blocks
        # 400 KB: needs compaction
        s.put("wide", torch.arange(100_000, dtype=torch.float32), "host")
        assert s.tiers_of("wide") == ["host"]
        for i in range(1, 8, 2):
            assert torch.equal(s.fetch(f"s{i}", "host").result(), small[f"s{i}"])
            s.release(f"s{i}", "host")


def test_concurrent_fetch_and_release_from_threads(store):
    data = _tensors(24, seed=4, max_numel=60_000)
    for key, t in data.items():
        store.put(key, t, "nvme")
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        keys = list(data)
        shared = keys[:12]  # read by every thread
        own = [k for i, k in enumerate(keys[12:]) if i % 4 == seed]  # modified by this one only
        try:
            for _ in range(60):
                key = rng.choice(shared + own)
                tier = rng.choice(["host", "device"])
                while True:
                    try:
                        t = store.fetch(key, tier).result(timeout=30)
                        break
                    except BudgetError:  # everything in use by other threads right now
                        continue
                if key in own:
                    t.add_(1) if t.dtype != torch.int64 else t.add_(1)
                    data[key] = t.clone()
                    store.release(key, tier, dirty=True)
                else:
                    assert torch.equal(t, data[key])
                    store.release(key, tier)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    _assert_holds(store, data)


def test_pinned_set_over_budget_is_a_clear_error(tmp_path):
    with TensorStore({"host": 1 * MiB, "nvme": 16 * MiB}, nvme_path=tmp_path) as s:
        for i in range(5):
            s.put(f"k{i}", torch.ones(60_000), "nvme")
        for i in range(4):
            s.pin(f"k{i}", "host")
        with pytest.raises(BudgetError, match="host tier cannot hold 'k4'.*pinned"):
            s.pin("k4", "host")
        s.unpin("k0", "host")
        s.pin("k4", "host")  # now k0 can make room


def test_write_back_failure_is_raised_and_loses_nothing(tmp_path):
    handle = aio.Handle(block_size=64 << 10)
    with TensorStore({"host": 1 * MiB, "nvme": 8 * MiB}, nvme_path=tmp_path,
                     aio_handle=handle) as s:
        s.put("w", torch.zeros(50_000), "nvme")
        t = s.fetch("w", "host").result()
        t.fill_(7.0)
        handle.inject(aio.Fault(op="write", nth=0, kind="errno", errno=errno.EIO))
        s.release("w", "host", dirty=True)
        with pytest.raises(aio.AIOError, match="EIO"):
            s.flush()
        assert s.tiers_of("w") == ["host"]  # the NVMe copy is stale; the host copy has the value
        assert torch.all(s.fetch("w", "host").result() == 7.0)
        s.release("w", "host", dirty=True)  # a retry writes it down
        s.flush()
        s.evict("w", "host")
        assert torch.all(s.fetch("w", "host").result() == 7.0)
        s.release("w", "host")
    handle.close()


def test_bad_construction_and_use(tmp_path):
    with pytest.raises(aio.AIOError, match="ENOENT.*No such file or directory"):
        TensorStore({"nvme": MiB}, nvme_path=tmp_path / "missing")
    with pytest.raises(ValueError, match="nvme_path"):
        TensorStore({"nvme": MiB})
    with pytest.raises(aio.AIOError, match="ENOSPC"):
        TensorStore({"nvme": 1 << 50}, nvme_path=tmp_path)  # 1 PiB: more than the disk
    with pytest.raises(ValueError, match="tier must be"):
        TensorStore({"gpu": MiB})
    with TensorStore({"host": MiB}) as s:
        with pytest.raises(BudgetError, match="larger than the whole host budget"):
            s.put("huge", torch.ones(MiB), "host")
        with pytest.raises(KeyError, match="no tensor 'x'"):
            s.fetch("x", "host")
        s.put("x", torch.ones(4), "host")
        with pytest.raises(ValueError, match="already in the store"):
            s.put("x", torch.ones(4), "host")
        with pytest.raises(ValueError, match="without a fetch"):
            s.release("x", "host")
        with pytest.raises(ValueError, match="not addressable"):
            s.fetch("x", "nvme")
        with pytest.raises(ValueError, match="no device budget"):
            s.fetch("x", "device")
    assert os.listdir(tmp_path) == []  # no swap files left behind


def test_read_only_nvme_path(read_only_dir, run_unprivileged):
    out = run_unprivileged(textwrap.dedent(f"""
        try:
            infinity.store.TensorStore({{"nvme": 1 << 20}}, nvme_path={read_only_dir!r})
        except aio.AIOError as e:
            print("ERR", e.errno, e); sys.exit(0)
        sys.exit(1)
    """))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ERR 13" in out.stdout and "not writable" in out.stdout


def test_trace_and_counters(store, tmp_path):
    store.put("a", torch.ones(100_000), "nvme")
    store.fetch("a", "device").result()
    store.release("a", "device", dirty=True)
    store.flush()
    stats = store.stats()
    assert stats["tiers"]["nvme"].used_nbytes >= 400_000
    moves = stats["moves"]
    # put, stage, copy, write-back
    lanes = ["host->nvme", "nvme->host", "host->device", "device->host"]
    assert sorted(moves) == sorted(lanes)
    # put + write-back
    counts = {"host->nvme": 2, "nvme->host": 1, "host->device": 1, "device->host": 1}
    assert all(moves[lane]["moves"] == n and moves[lane]["nbytes"] == n * 400_000
               for lane, n in counts.items())
    assert moves["host->nvme"]["gbps"] > 0
    path = tmp_path / "trace.json"
    store.write_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    slices = [e for e in events if e["ph"] == "X"]
    # one slice per move, on its direction's row, with its bytes and a real duration
    assert sorted(names[e["tid"]] for e in slices) == sorted(["host->nvme"] * 2 + lanes[1:])
    assert all(e["name"] == "a" and e["args"]["nbytes"] == 400_000 and e["dur"] > 0 for e in slices)
    start = {names[e["tid"]]: e["ts"] for e in slices}
    read = next(e for e in slices if names[e["tid"]] == "nvme->host")
    # the device copy waits for the staged read
    assert read["ts"] + read["dur"] <= start["host->device"]
    assert start["host->device"] < start["device->host"]


class _LazyEvent:
    """Stands in for a CUDA event on a side stream: the copy happens only when waited for,
    so any code that reads the destination (or reuses the source) too early sees wrong bytes."""

    def __init__(self, dst, src):
        self._dst, self._src = dst, src.clone()  # a stream reads its source at some later time
        self._done = False

    def synchronize(self):
        if not self._done:
            self._dst.copy_(self._src)
            self._done = True

    def query(self):
        return self._done


def test_async_device_copies_are_ordered(tmp_path, monkeypatch):
    """The side-stream path (CUDA) run on the CPU with deferred copies: every tier path must
    wait for its copy before the bytes are used, written down or freed."""
    monkeypatch.setattr(Copies, "device_copy", lambda self, dst, src: _LazyEvent(dst, src))
    with TensorStore({"device": 1 * MiB, "host": 2 * MiB, "nvme": 64 * MiB}, nvme_path=tmp_path,
                     device="cpu") as store:
        store._copies.copy_stream = object()  # take the accelerator paths: staging through host
        data = _tensors(30, seed=9, max_numel=100_000)
        for key, t in data.items():
            store.put(key, t, "nvme")
        rng = random.Random(9)
        for _ in range(150):
            key = rng.choice(list(data))
            t = store.fetch(key, "device").result(timeout=30)
            assert torch.equal(t, data[key])
            modify = rng.random() < 0.4
            if modify:
                t.add_(1) if t.dtype != torch.int64 else t.add_(2)
                data[key] = t.clone()
            store.release(key, "device", dirty=modify)
            if rng.random() < 0.2:
                store.evict(key, "host")  # the write-back must then go device -> host -> nvme
        store.flush()
        for key in data:
            store.evict(key, "device")
            store.evict(key, "host")
        _assert_holds(store, data)


def test_two_stores_share_a_directory(tmp_path):
    with (TensorStore({"nvme": MiB}, nvme_path=tmp_path) as a,
          TensorStore({"nvme": MiB}, nvme_path=tmp_path) as b):
        a.put("x", torch.full((1000,), 1.0), "nvme")
        b.put("x", torch.full((1000,), 2.0), "nvme")
        assert os.listdir(tmp_path) == []  # both swap files are unlinked: no names to collide
    with TensorStore({"host": MiB, "nvme": MiB}, nvme_path=tmp_path) as a, \
            TensorStore({"host": MiB, "nvme": MiB}, nvme_path=tmp_path) as b:
        a.put("x", torch.full((1000,), 1.0), "nvme")
        b.put("x", torch.full((1000,), 2.0), "nvme")
        assert torch.all(a.fetch("x", "host").result() == 1.0)
        assert torch.all(b.fetch("x", "host").result() == 2.0)
    assert os.listdir(tmp_path) == []


def test_failed_put_gives_its_space_back(tmp_path):
    handle = aio.Handle()
    with TensorStore({"nvme": MiB}, nvme_path=tmp_path, aio_handle=handle) as s:
        handle.inject(aio.Fault(op="write", nth=0, kind="errno", errno=errno.EIO))
        with pytest.raises(aio.AIOError, match="EIO"):
            s.put("x", torch.ones(200_000), "nvme")  # 800 KB of the 1 MiB tier
        assert "x" not in s and s.stats()["tiers"]["nvme"].used_nbytes == 0
        s.put("x", torch.ones(200_000), "nvme")  # the space is there again
        assert s.stats()["tiers"]["nvme"].largest_free_nbytes < MiB - 800_000
    handle.close()


def test_failed_read_is_raised_by_result_and_can_be_retried(tmp_path):
    handle = aio.Handle()
    with TensorStore({"host": MiB, "nvme": MiB}, nvme_path=tmp_path, aio_handle=handle) as s:
        s.put("x", torch.arange(1000.0), "nvme")
        handle.inject(aio.Fault(op="read", nth=0, kind="errno", errno=errno.EIO))
        future = s.fetch("x", "host")
        with pytest.raises(aio.AIOError, match="EIO"):
            future.result(timeout=30)
        s.release("x", "host")
        assert s.tiers_of("x") == ["nvme"]  # the host copy never got its bytes
        assert torch.equal(s.fetch("x", "host").result(timeout=30), torch.arange(1000.0))
        s.release("x", "host")
    handle.close()


@pytest.mark.requires_cuda
def test_real_cuda_side_stream_paths(tmp_path):
    """The accelerator paths on a real GPU: staging through pinned host memory, copies on the
    side stream, write-backs device -> host -> NVMe, all read back bit for bit."""
    with TensorStore({"device": 1 * MiB, "host": 2 * MiB, "nvme": 64 * MiB}, nvme_path=tmp_path,
                     device="cuda") as store:
        assert store._copies.copy_stream is not None and store._tiers.arenas[Tier.HOST].pinned
        data = _tensors(30, seed=11, max_numel=100_000)
        for key, t in data.items():
            store.put(key, t, "nvme")
        rng = random.Random(11)
        for _ in range(150):
            key = rng.choice(list(data))
            t = store.fetch(key, "device").result(timeout=30)
            assert t.is_cuda and torch.equal(t.cpu(), data[key])
            modify = rng.random() < 0.4
            if modify:
                t.add_(1) if t.dtype != torch.int64 else t.add_(2)
                data[key] = t.cpu()
            store.release(key, "device", dirty=modify)
            if rng.random() < 0.2:
                store.evict(key, "host")
        store.flush()
        for key in data:
            store.evict(key, "device")
            store.evict(key, "host")
            assert store.tiers_of(key) == ["nvme"]
        _assert_holds(store, data)
        moves = store.stats()["moves"]
        assert moves["device->host"]["moves"] > 0 and moves["host->device"]["moves"] > 0


@pytest.mark.parametrize("tier", ["nvme", "host"])
@pytest.mark.parametrize("checksum", [False, True], ids=["plain", "checksum"])
def test_put_chunks_streams_a_tensor_in_pieces(tmp_path, tier, checksum):
    """Pieces land in order into one entry that reads back whole (and verifies, with checksums);
    a wrong count, dtype or a failing producer leaves no key and no space behind."""
    with TensorStore({"host": 4 * MiB, "nvme": 8 * MiB}, nvme_path=tmp_path,
                     checksum=checksum) as s:
        t = torch.randn(300_000)
        s.put_chunks("t", (600, 500), torch.float32, t.split(64 << 10), tier)
        assert s.tiers_of("t") == [tier]
        assert torch.equal(s.fetch("t").result(), t.view(600, 500))
        s.release("t")
        used = s.stats()["tiers"][tier].used_nbytes

        def failing():
            yield torch.zeros(10)
            raise OSError("the producer failed")

        cases = [([torch.zeros(10)], ValueError, "gave 40 of 400 bytes"),
                 ([torch.zeros(101)], ValueError, "exceed 400 bytes"),
                 ([torch.zeros(100, dtype=torch.float64)], ValueError, "expected torch.float32"),
                 (failing(), OSError, "the producer failed")]
        for chunks, error, message in cases:
            with pytest.raises(error, match=message):
                s.put_chunks("u", (100,), torch.float32, chunks, tier)
            assert "u" not in s
            assert s.stats()["tiers"][tier].used_nbytes == used
        with pytest.raises(ValueError, match="already in the store"):
            s.put_chunks("t", (1,), torch.float32, [torch.zeros(1)], tier)


def _reads(store):
    return store.stats()["moves"].get("nvme->host", {}).get("moves", 0)


def test_an_overwrite_reads_nothing_and_its_bytes_become_the_value(store):
    store.put("a", torch.ones(100_000), "nvme")
    with store.hold("a", overwrite=True) as a:  # no host copy: its bytes are not read in
        a.fill_(7.0)
    store.flush()
    assert _reads(store) == 0
    assert store.tiers_of("a") == ["host", "nvme"]  # written down (overwrite implies dirty)
    store.evict("a", "host")
    _assert_holds(store, {"a": torch.full((100_000,), 7.0)})
    assert _reads(store) == 1
    with store.hold("a", overwrite=True) as a:  # a current host copy is used as it is
        a[:10] = 3.0  # (a caller writes every element; this one checks no copy was made)
    store.evict("a", "host")
    _assert_holds(store, {"a": torch.cat([torch.full((10,), 3.0), torch.full((99_990,), 7.0)])})


def test_an_overwrite_is_refused_while_the_key_is_in_use_and_holds_what_a_failed_block_wrote(
        store):
    store.put("a", torch.ones(1000), "nvme")
    store.fetch("a", "host").result()
    with pytest.raises(ValueError, match="cannot overwrite 'a': it is in use on host"):
        store.fetch("a", "host", overwrite=True)
    store.release("a", "host")
    store.evict("a", "host")
    with pytest.raises(RuntimeError, match="halfway"), store.hold("a", overwrite=True) as a:
        a.fill_(5.0)
        raise RuntimeError("halfway")
    store.flush()
    store.evict("a", "host")  # the block's bytes were released dirty: they are the value
    _assert_holds(store, {"a": torch.full((1000,), 5.0)})


def test_the_store_names_the_directory_of_its_swap_file(tmp_path):
    """What infinity-train samples the disk under ([Note: a disk that pauses]); None without
    an NVMe tier."""
    with TensorStore({"host": 1 << 20, "nvme": 1 << 20}, nvme_path=tmp_path) as store:
        assert store.nvme_directory == str(tmp_path)
    with TensorStore({"host": 1 << 20}) as store:
        assert store.nvme_directory is None
