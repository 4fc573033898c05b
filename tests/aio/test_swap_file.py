"""SwapFile: preallocation failures at creation, the extent allocator, and I/O into extents."""

import errno
import os
import random
import textwrap

import pytest
import torch
from children import python_child

import aio


def test_extents_are_aligned_and_reused(tmp_path):
    with aio.SwapFile(tmp_path / "swap", 1 << 20) as f:
        assert os.path.getsize(f.path) == 1 << 20
        assert os.listdir(tmp_path) == []  # unlinked from the start
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


def test_write_in_pieces_at_offsets(tmp_path):
    """A tensor written piece by piece (`at`) reads back whole; a piece past the end is refused."""
    with aio.SwapFile(tmp_path / "swap", 8 << 20) as f, aio.Handle() as h:
        t = torch.randn(3 * 4096 + 5)
        e = f.allocate(t.numel() * 4)
        for first in range(0, t.numel(), 4096):
            f.write(h, e, t[first:first + 4096], at=first * 4).wait()
        out = torch.empty_like(t)
        f.read(h, e, out).wait()
        assert torch.equal(out, t)
        with pytest.raises(ValueError, match="at 49152 does not fit"):
            f.write(h, e, torch.ones(6), at=4 * 3 * 4096)
        with pytest.raises(ValueError, match="does not fit"):
            f.write(h, e, torch.ones(1), at=-4)


def test_missing_directory(tmp_path):
    with pytest.raises(aio.AIOError, match="does not exist"):
        aio.SwapFile(tmp_path / "nope" / "swap", 1 << 20)


def test_disk_full_fails_at_creation(small_disk):
    """On a 1 MiB disk a 4 MiB swap file fails at creation with ENOSPC, leaving nothing."""
    mnt = small_disk("1m")
    with pytest.raises(aio.AIOError) as info:
        aio.SwapFile(mnt / "swap", 4 << 20)
    assert info.value.errno == errno.ENOSPC and "swap" in str(info.value)
    assert os.listdir(mnt) == []


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
    out = python_child(["-c", code], timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"ERR {errno.EFBIG}" in out.stdout and "ulimit -f" in out.stdout
    assert not os.path.exists(tmp_path / "swap")


CHILD_WITH_SWAP_FILE = """
import torch, aio
swap = aio.SwapFile(DIRECTORY + "/run.swap", 64 << 20)
handle = aio.Handle()  # keeps its own descriptors to the file too
extent = swap.allocate(1 << 20)
swap.write(handle, extent, torch.ones(1 << 18)).wait()
print(swap.name, flush=True)
"""


def test_sigkill_leaves_no_swap_file_and_frees_its_space(sigkilled_child_frees):
    """A process killed with SIGKILL holding a 64 MiB swap file (and a handle using it) leaves
    no file, and the file system's used space returns to what it was."""
    sigkilled_child_frees(CHILD_WITH_SWAP_FILE, "128m", 64 << 20)


def test_messages_name_the_directory_and_say_unlinked(tmp_path):
    with aio.SwapFile(tmp_path / "swap", 64 << 10) as f, \
            aio.Handle(faults=[aio.Fault("read", 0, "errno", errno.EIO)]) as h:
        assert f.name == f"{tmp_path} (unlinked swap file)" and str(tmp_path) in repr(f)
        e = f.allocate(64 << 10)
        with pytest.raises(aio.AIOError, match="unlinked swap file"):
            f.allocate(1)
        with pytest.raises(aio.AIOError) as info:
            f.read(h, e, torch.empty(16)).wait()
        assert info.value.errno == errno.EIO and info.value.filename == f.name
    with pytest.raises(ValueError, match="closed"):
        f.fileno()


def test_close_frees_the_space_even_while_the_handle_stays_open(small_tmpfs):
    """The handle's own descriptors to the file would keep its blocks: close() has it forget
    them."""
    mnt = small_tmpfs("16m")
    if mnt is None:
        pytest.skip("cannot mount a size-limited tmpfs here (needs root)")
    with aio.Handle() as h:
        for _ in range(3):  # 3 x 8 MiB only fits if each file's space comes back
            f = aio.SwapFile(mnt / "swap", 8 << 20)
            e = f.allocate(4096)
            f.write(h, e, torch.ones(1024)).wait()
            f.close()
            assert os.statvfs(mnt).f_bfree == os.statvfs(mnt).f_blocks


def test_without_o_tmpfile_the_file_is_unlinked_right_after_creation(tmp_path, monkeypatch):
    real_open = os.open

    def open_without_tmpfile(path, flags, *args):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "O_TMPFILE not supported")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", open_without_tmpfile)
    with aio.SwapFile(tmp_path / "swap", 1 << 20) as f, aio.Handle() as h:
        assert os.listdir(tmp_path) == [] and os.fstat(f.fileno()).st_nlink == 0
        data = torch.arange(4096, dtype=torch.float32)
        e = f.allocate(data.nbytes)
        f.write(h, e, data).wait()
        out = torch.empty_like(data)
        f.read(h, e, out).wait()
        assert torch.equal(out, data)
    (tmp_path / "taken.swap").write_bytes(b"user data")
    with pytest.raises(aio.AIOError) as info:  # never clobbers a file of that name
        aio.SwapFile(tmp_path / "taken.swap", 1 << 20)
    assert info.value.errno == errno.EEXIST
    assert (tmp_path / "taken.swap").read_bytes() == b"user data"
