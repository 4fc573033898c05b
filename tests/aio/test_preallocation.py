"""Writes past the end of a file preallocate their range: see [Note: preallocating extending
writes] in csrc/aio/handle.c."""

import os

import pytest

import aio

BLOCK = 1 << 20


@pytest.mark.parametrize("backend", aio.available_backends())
def test_an_extending_write_allocates_its_whole_range_before_any_piece_runs(tmp_path, backend):
    path = tmp_path / "new"
    buf = aio.aligned_empty(BLOCK)
    # the only piece is held, so whatever the file holds now came from the submission itself
    with aio.Handle(BLOCK, 4, 1, backend, faults=[aio.Fault(op="write", nth=0, kind="hang")]) as h:
        request = h.write(buf, path, offset=3 * BLOCK)
        st = os.stat(path)
        assert st.st_size == 4 * BLOCK
        assert st.st_blocks * 512 >= BLOCK  # the range is allocated, not a hole
    with pytest.raises(aio.AIOError, match="cancelled"):
        request.wait()


@pytest.mark.parametrize("backend", aio.available_backends())
def test_writes_inside_the_file_leave_its_size_and_data_alone(tmp_path, backend):
    path = tmp_path / "old"
    path.write_bytes(b"\1" * (4 * BLOCK))
    buf = aio.aligned_empty(BLOCK)
    buf.fill_(2)
    with aio.Handle(BLOCK, 4, 1, backend) as h:
        assert h.write(buf, path, offset=BLOCK).wait() == BLOCK
    data = path.read_bytes()
    assert len(data) == 4 * BLOCK
    assert data == b"\1" * BLOCK + b"\2" * BLOCK + b"\1" * (2 * BLOCK)


def test_a_write_straddling_the_end_extends_the_file_exactly(tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"\1" * BLOCK)
    buf = aio.aligned_empty(2 * BLOCK + 100)
    buf.fill_(3)
    with aio.Handle(BLOCK, 4) as h:
        assert h.write(buf, path, offset=BLOCK // 2).wait() == buf.nbytes
    data = path.read_bytes()
    assert len(data) == BLOCK // 2 + buf.nbytes
    assert data[:BLOCK // 2] == b"\1" * (BLOCK // 2) and data[BLOCK // 2:] == b"\3" * buf.nbytes
