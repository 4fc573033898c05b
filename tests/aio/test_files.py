"""File opening: O_DIRECT where allowed, buffered with one warning where not, alignment."""

import errno
import logging
import os
import tempfile

import pytest
import torch

import aio
from aio import _files


def _refuse_direct_io(monkeypatch) -> None:
    """From now on the engine's opener sees O_DIRECT refused, as on a file system without it."""
    real_open = os.open

    def refuse_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(_files.os, "open", refuse_direct)
    monkeypatch.setattr(_files, "_warned_devices", set())


def test_direct_io_refused_falls_back_to_buffered_with_one_warning(tmp_path, monkeypatch, caplog,
                                                                   backend):
    _refuse_direct_io(monkeypatch)
    caplog.set_level(logging.WARNING, logger="aio._files")
    with aio.Handle(backend=backend) as h:
        t = torch.randn(300_000)
        for i in range(3):
            h.write(t, tmp_path / f"f{i}").wait()
            out = torch.empty_like(t)
            h.read(out, tmp_path / f"f{i}").wait()
            assert torch.equal(out, t)
    warnings = [r for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1


def test_direct_io_supported_asks_the_engines_opener_and_leaves_nothing(tmp_path, monkeypatch):
    opened = _files.open_file(str(tmp_path / "f"), writable=True)
    opened.close()
    os.unlink(tmp_path / "f")
    assert aio.direct_io_supported(str(tmp_path)) is (opened.direct_fd >= 0)
    _refuse_direct_io(monkeypatch)
    assert aio.direct_io_supported(str(tmp_path)) is False
    assert os.listdir(tmp_path) == []
    with pytest.raises(aio.AIOError, match="open for write"):
        aio.direct_io_supported(str(tmp_path / "missing"))


def test_tmpfs_round_trip(backend):
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d, aio.Handle(backend=backend) as h:
        t = torch.randn(123_457)
        h.write(t, os.path.join(d, "x")).wait()
        out = torch.empty_like(t)
        h.read(out, os.path.join(d, "x")).wait()
        assert torch.equal(out, t)


def test_alignment_is_at_least_a_page(tmp_path):
    opened = _files.open_file(str(tmp_path / "a"), writable=True)
    try:
        assert opened.direct_align >= 4096 and opened.direct_align & (opened.direct_align - 1) == 0
        assert opened.mem_align >= 1
    finally:
        opened.close()


def test_aligned_empty():
    for n in (0, 1, 4095, 1 << 20):
        b = aio.aligned_empty(n)
        assert b.dtype == torch.uint8 and b.numel() == n and b.data_ptr() % 4096 == 0
    assert aio.aligned_empty(100, 64).data_ptr() % 64 == 0
    with pytest.raises(ValueError):
        aio.aligned_empty(-1)
    with pytest.raises(ValueError):
        aio.aligned_empty(10, alignment=3)


def _descriptors_of(fd: int) -> list[int]:
    """This process's descriptors open on the same file as `fd`."""
    st = os.fstat(fd)
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            other = os.stat(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino):
            found.append(int(name))
    return found


def test_open_files_are_reached_through_their_descriptor(tmp_path, backend):
    """An open file given by descriptor works unlinked, is named by its `name` in messages,
    and forget() lets the handle let go of it."""
    with open(tmp_path / "data", "w+b") as f, \
            aio.Handle(block_size=64 << 10, backend=backend) as h:
        os.unlink(tmp_path / "data")
        data = torch.arange(100_000, dtype=torch.float32)
        h.write(data, f, 4096).wait()
        assert len(_descriptors_of(f.fileno())) > 1  # the handle opened its own
        out = torch.empty_like(data)
        h.read(out, f, 4096).wait()
        assert torch.equal(out, data)
        with pytest.raises(aio.AIOError) as info:
            h.read(torch.empty(10), f, 4096 + data.nbytes).wait()
        assert info.value.filename == f.name and "the file has 404096 bytes" in str(info.value)
        h.forget(f)
        h.forget(f)  # nothing left to forget: a no-op
        assert _descriptors_of(f.fileno()) == [f.fileno()]
        with pytest.raises(TypeError, match="path or an open file"):
            h.read(out, 42)
