"""SwapFile: preallocation failures at creation, the extent allocator, and I/O into extents."""

import errno
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

import aio


def test_extents_are_aligned_and_reused(tmp_path):
    with aio.SwapFile(tmp_path / "swap", 1 << 20) as f:
        assert os.path.getsize(f.path) == 1 << 20
        a = f.allocate(10)
        b = f.allocate(5000)
        assert a.offset % f.alignment == 0 and b.offset % f.alignment == 0
        assert a.capacity == f.alignment and b.capacity == 2 * f.alignment
        assert b.offset >= a.offset + a.capacity
        f.free(a)
        f.free(b)
        assert f.free_nbytes() == f.nbytes
        whole = f.allocate(f.nbytes)  # holes coalesced back into one
        assert whole.offset == 0
    assert not os.path.exists(tmp_path / "swap")


def test_random_allocate_free_never_overlaps(tmp_path):
    rng = random.Random(7)
    with aio.SwapFile(tmp_path / "swap", 4 << 20) as f:
        live = []
        for _ in range(3000):
            if live and rng.random() < 0.45:
                f.free(live.pop(rng.randrange(len(live))))
                continue
            try:
                live.append(f.allocate(rng.randrange(1, 64 << 10)))
            except aio.AIOError as exc:
                assert exc.errno == errno.ENOSPC and "largest hole" in str(exc)
        spans = sorted((e.offset, e.offset + e.capacity) for e in live)
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
        assert f.free_nbytes() == f.nbytes - sum(e.capacity for e in live)


def test_full_and_double_free(tmp_path):
    with aio.SwapFile(tmp_path / "swap", 64 << 10) as f:
        e = f.allocate(64 << 10)
        with pytest.raises(aio.AIOError, match="swap file full"):
            f.allocate(1)
        f.free(e)
        with pytest.raises(ValueError, match="not a live extent"):
            f.free(e)


def test_write_read_through_extents(tmp_path):
    with aio.SwapFile(tmp_path / "swap", 8 << 20) as f, aio.Handle() as h:
        tensors = [torch.randn(n) for n in (1, 1000, 262_144, 77_777)]
        extents = [f.allocate(t.numel() * 4) for t in tensors]
        for e, t in zip(extents, tensors):
            f.write(h, e, t)
        h.wait_all()
        for e, t in zip(extents, tensors):
            out = torch.empty_like(t)
            f.read(h, e, out).wait()
            assert torch.equal(out, t)
        with pytest.raises(ValueError, match="does not fit"):
            f.write(h, extents[0], torch.ones(2))


def test_missing_directory(tmp_path):
    with pytest.raises(aio.AIOError, match="does not exist"):
        aio.SwapFile(tmp_path / "nope" / "swap", 1 << 20)


def test_disk_full_fails_at_creation(tmp_path):
    """On a 1 MiB file system a 4 MiB swap file fails at creation with ENOSPC, leaving nothing."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a size-limited tmpfs here (needs root)")
    try:
        with pytest.raises(aio.AIOError) as info:
            aio.SwapFile(mnt / "swap", 4 << 20)
        assert info.value.errno == errno.ENOSPC and "swap" in str(info.value)
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_file_size_limit_fails_at_creation(tmp_path):
    """RLIMIT_FSIZE (ulimit -f) makes preallocation fail with EFBIG at creation, not mid-run."""
    code = textwrap.dedent(f"""
        import resource, sys, aio
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            aio.SwapFile({str(tmp_path / 'swap')!r}, 8 << 20)
        except aio.AIOError as e:
            print("ERR", e.errno, e)
            sys.exit(0)
        sys.exit(1)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"ERR {errno.EFBIG}" in out.stdout and "ulimit -f" in out.stdout
    assert not os.path.exists(tmp_path / "swap")
