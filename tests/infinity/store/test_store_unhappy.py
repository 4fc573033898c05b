"""TensorStore's unhappy paths: full tiers, misuse, prefetch limits, a real full disk."""

import logging
import os

import pytest
import torch

from infinity.errors import BudgetError
from infinity.store import TensorStore, Tier

MiB = 1 << 20


def _nvme_host(tmp_path, host=MiB, nvme=16 * MiB):
    return TensorStore({"host": host, "nvme": nvme}, nvme_path=tmp_path)


def test_prefetch_reports_what_it_started_and_stops_at_the_first_key_that_does_not_fit(tmp_path,
                                                                                       caplog):
    with _nvme_host(tmp_path) as s:
        for i in range(5):
            s.put(f"k{i}", torch.full((75_000,), float(i)), "nvme")  # 300 KB each: 3 fit in 1 MiB
        with caplog.at_level(logging.DEBUG, logger="infinity.store"):
            assert s.prefetch([f"k{i}" for i in range(5)], "host") == ["k0", "k1", "k2"]
        assert "stops at 'k3'" in caplog.text
        assert [s.tiers_of(f"k{i}") for i in range(5)] == [["host", "nvme"]] * 3 + [["nvme"]] * 2
        s.flush()
        reads = s.stats()["moves"]["nvme->host"]["moves"]
        assert reads == 3
        assert s.prefetch(["k1", "k0"], "host") == ["k1", "k0"]  # present
        for i in range(3):  # the prefetched copies are used: no read again
            assert torch.all(s.fetch(f"k{i}", "host").result(timeout=30) == i)
            s.release(f"k{i}", "host")
        assert s.stats()["moves"]["nvme->host"]["moves"] == reads
        assert s.prefetch(["k3"], "host") == ["k3"]  # fetched copies may now make room
        with pytest.raises(KeyError, match="no tensor 'nope'"):
            s.prefetch(["nope"], "host")


def test_prefetched_copies_are_evicted_last(tmp_path):
    with _nvme_host(tmp_path) as s:
        for key in ("c0", "c1", "p0", "p1", "p2", "n"):
            s.put(key, torch.full((50_000,), 1.0), "nvme")  # 200 KB each: 5 fit in 1 MiB
        for key in ("c0", "c1"):
            s.fetch(key, "host").result(timeout=30)
            s.release(key, "host")
        assert s.prefetch(["p0", "p1", "p2"], "host") == ["p0", "p1", "p2"]
        # hints say: the p's last
        s.set_next_use({"p0": 1000, "p1": 1000, "p2": 1000, "c0": 2, "c1": 1})
        s.fetch("n", "host").result(timeout=30)  # needs one slot
        assert s.tiers_of("c0") == ["nvme"]  # a cached copy went, needed soon or not
        assert all("host" in s.tiers_of(k) for k in ("c1", "p0", "p1", "p2"))
        s.release("n", "host")


def test_next_use_hints_are_distances_on_the_fetch_clock(tmp_path):
    with _nvme_host(tmp_path) as s:
        for key in ("a", "b", "c", "big"):
            s.put(key, torch.ones(60_000 if key != "big" else 100_000), "nvme")
        for key in ("a", "b", "c"):
            # at clock 1, 2, 3: needed at 6, 7, 8
            s.fetch(key, "host", next_use=5).result(timeout=30)
            s.release(key, "host")
        assert s.clock == 3
        s.set_next_use({"a": 3})  # needed at clock 6: still the soonest of the three
        s.set_next_use({"b": 4})  # needed at 7 ... then c (8) is the farthest
        s.fetch("big", "host").result(timeout=30)
        assert (s.tiers_of("c") == ["nvme"] and "host" in s.tiers_of("a")
                and "host" in s.tiers_of("b"))
        with pytest.raises(ValueError, match="next-use hint for 'a'"):
            s.set_next_use({"a": float("nan")})
        with pytest.raises(ValueError, match="next-use hint for 'a'"):
            s.fetch("a", "host", next_use="soon")


def test_nvme_tier_full_names_the_key_and_the_budget(tmp_path):
    with TensorStore({"nvme": MiB}, nvme_path=tmp_path) as s:
        s.put("x", torch.ones(200_000), "nvme")  # 800 KB
        with pytest.raises(BudgetError, match=r"nvme tier cannot hold 'y' \(400000 bytes\)"
                                              r".*1048576-byte nvme budget"):
            s.put("y", torch.ones(100_000), "nvme")
        assert "y" not in s
        s.drop("x")
        s.put("y", torch.ones(100_000), "nvme")


def test_evicting_a_home_copy_when_nvme_is_full_is_a_clear_error_and_loses_nothing(tmp_path):
    with TensorStore({"host": MiB, "nvme": MiB}, nvme_path=tmp_path) as s:
        s.put("n", torch.ones(200_000), "nvme")  # 800 KB of the 1 MiB swap file
        s.put("h", torch.full((100_000,), 2.0), "host")  # 400 KB at home on host
        with pytest.raises(BudgetError,
                           match="cannot evict 'h' from host: nvme tier cannot hold 'h'"):
            s.put("h2", torch.ones(175_000), "host")  # 700 KB: h would have to move down
        assert "h2" not in s and s.tiers_of("h") == ["host"]
        assert torch.all(s.fetch("h", "host").result() == 2.0)
        s.release("h", "host")
        with pytest.raises(BudgetError, match="cannot evict 'h' from host"):
            s.evict("h", "host")
        s.drop("n")
        s.evict("h", "host")  # room now: it moves down
        assert s.tiers_of("h") == ["nvme"]


def test_misuse_of_keys_in_use_or_not_pinned_is_a_clear_error(tmp_path):
    with _nvme_host(tmp_path) as s:
        s.put("k", torch.ones(1000), "nvme")
        s.fetch("k", "host").result()
        with pytest.raises(ValueError,
                           match=r"cannot evict 'k' from host: it is in use \(1 fetches"):
            s.evict("k", "host")
        with pytest.raises(ValueError, match="cannot drop 'k': it is in use on host"):
            s.drop("k")
        with pytest.raises(ValueError, match="unpin of 'k' on host that is not pinned"):
            s.unpin("k", "host")
        s.release("k", "host")
        s.pin("k", "host")
        with pytest.raises(ValueError, match=r"pinned \(1 pins\)"):
            s.evict("k", "host")
        s.unpin("k", "host")
        with pytest.raises(ValueError, match="unpin of 'k' on host that is not pinned"):
            s.unpin("k", "host")
        s.evict("k", "host")
        s.drop("k")
        with pytest.raises(KeyError, match="no tensor 'k'"):
            s.drop("k")


def test_a_full_disk_fails_at_start_up(small_disk):
    disk = small_disk("4m")
    with pytest.raises(OSError, match="ENOSPC") as refused:
        TensorStore({"nvme": 8 * MiB}, nvme_path=disk)  # more than the file system holds
    assert str(disk) in str(refused.value) and os.listdir(disk) == []


def test_a_store_that_started_never_fails_on_a_full_disk(small_tmpfs):
    """A real 4 MiB file system filled to the last byte while the store is open: its space was
    taken at start-up, so write-backs go on. Only the kernel's ENOSPC says this (the write
    path's own handling of ENOSPC is tested with an injected aio.Fault, test_store_threads)."""
    disk = small_tmpfs("4m")
    if disk is None:
        pytest.skip("needs a real full file system: mounting a small tmpfs needs root")
    with TensorStore({"host": MiB, "nvme": 2 * MiB}, nvme_path=disk) as s:
        with open(disk / "filler", "wb") as f:  # now fill the disk to the last byte
            with pytest.raises(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        data = {f"k{i}": torch.full((100_000,), float(i)) for i in range(4)}  # 1.6 MB
        for key, t in data.items():
            s.put(key, t, "nvme")
        for key, t in data.items():  # modify and write back through a 1 MiB host tier
            s.fetch(key, "host").result(timeout=30).add_(1)
            t.add_(1)
            s.release(key, "host", dirty=True)
        s.flush()
        for key, t in data.items():
            s.evict(key, "host")
            assert torch.equal(s.fetch(key, "host").result(timeout=30), t)
            s.release(key, "host")
    os.unlink(disk / "filler")
    with TensorStore({"nvme": 3 * MiB}, nvme_path=disk):
        with pytest.raises(OSError, match="ENOSPC"):  # a second store does not fit beside it
            TensorStore({"nvme": 2 * MiB}, nvme_path=disk)


@pytest.mark.parametrize("checksum", [True, False])
def test_a_swap_file_changed_behind_the_store_is_caught_by_the_checksum(tmp_path, checksum):
    with TensorStore({"host": MiB, "nvme": 8 * MiB}, nvme_path=tmp_path, checksum=checksum) as s:
        s.put("a", torch.arange(10_000.0), "nvme")
        s.put("b", torch.arange(20_000.0), "nvme")
        t = s.fetch("b", "host").result()
        t.add_(1)
        s.release("b", "host", dirty=True)  # a write-back, checksummed too
        s.flush()
        s.evict("b", "host")
        offsets = {k: s._copies.entries[k].copies[Tier.NVME].extent.offset for k in ("a", "b")}
        for offset in offsets.values():
            # one float, 4 KiB in
            os.pwrite(s._tiers.swap.fileno(), b"\x01\x02\x03\x04", offset + 4096)
        for key, expected in (("a", torch.arange(10_000.0)), ("b", torch.arange(20_000.0) + 1)):
            future = s.fetch(key, "host")
            if not checksum:  # without the checksum the damage goes unseen
                assert not torch.equal(future.result(timeout=30), expected)
                s.release(key, "host")
                continue
            with pytest.raises(OSError, match=rf"verify '{tmp_path}.*' at offset {offsets[key]}.*"
                                              rf"checksum mismatch reading '{key}'"):
                future.result(timeout=30)
            with pytest.raises(OSError, match="checksum mismatch"):  # read again: still wrong
                future.result(timeout=30)
            s.release(key, "host")
            assert s.tiers_of(key) == ["nvme"]  # the bad bytes are never handed out
