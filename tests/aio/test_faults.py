"""Injected faults give the documented error, never a hang or silent loss."""

import errno

import pytest
import torch

import aio


def _faulty(backend, *faults, block_size=64 << 10):
    return aio.Handle(block_size=block_size, queue_depth=4, threads=1, backend=backend,
                      faults=faults)


def test_eio_on_write_names_the_failed_piece(backend, tmp_path):
    with _faulty(backend, aio.Fault(op="write", nth=2, kind="errno", errno=errno.EIO)) as h:
        t = torch.ones(64 << 10)  # 256 KiB = 4 pieces
        with pytest.raises(aio.AIOError) as info:
            h.write(t, tmp_path / "x", offset=0).wait(timeout=30)
        err = info.value
        assert err.errno == errno.EIO and err.op == "write" and err.nbytes == 64 << 10
        assert err.offset % (64 << 10) == 0 and str(tmp_path / "x") in str(err)
        # the handle stays usable after a failed request
        assert h.write(t, tmp_path / "y").wait(timeout=30) == t.numel() * 4


def test_enospc_on_write(backend, tmp_path):
    with _faulty(backend, aio.Fault(op="write", nth=0, kind="errno", errno=errno.ENOSPC)) as h:
        with pytest.raises(aio.AIOError, match="ENOSPC"):
            h.write(torch.ones(10), tmp_path / "x").wait(timeout=30)


def test_eio_on_read(backend, tmp_path):
    with _faulty(backend) as h:
        t = torch.arange(100_000, dtype=torch.float32)
        h.write(t, tmp_path / "x").wait()
        h.inject(aio.Fault(op="read", nth=0, kind="errno", errno=errno.EIO))
        with pytest.raises(aio.AIOError, match="EIO"):
            h.read(torch.empty_like(t), tmp_path / "x").wait(timeout=30)


@pytest.mark.parametrize("op", ["write", "read"])
def test_short_transfer_is_resumed(backend, tmp_path, op):
    t = torch.randn(200_000)
    with _faulty(backend) as h:
        if op == "read":
            h.write(t, tmp_path / "x").wait()
        for nth in range(3):  # several pieces come back short, by odd amounts
            h.inject(aio.Fault(op=op, nth=nth, kind="short", nbytes=1000 + nth))
        if op == "write":
            assert h.write(t, tmp_path / "x").wait(timeout=30) == t.numel() * 4
        out = torch.empty_like(t)
        assert h.read(out, tmp_path / "x").wait(timeout=30) == t.numel() * 4
        assert torch.equal(out, t)


def test_request_that_never_completes_times_out_and_close_cancels(backend, tmp_path):
    h = _faulty(backend, aio.Fault(op="write", nth=1, kind="hang"))
    r = h.write(torch.ones(64 << 10), tmp_path / "x")  # 4 pieces, the second hangs
    with pytest.raises(aio.AIOTimeoutError) as info:
        r.wait(timeout=0.2)
    assert isinstance(info.value, TimeoutError) and "still in flight" in str(info.value)
    assert not r.done()
    with pytest.raises(aio.AIOTimeoutError):
        h.wait_all(timeout=0.1)
    h.close()
    with pytest.raises(aio.AIOError) as info:
        r.wait(timeout=5)
    assert info.value.errno == errno.ECANCELED and "closed" in str(info.value)


def test_fault_validation():
    with pytest.raises(ValueError, match="kind"):
        aio.Fault(kind="explode")
    with pytest.raises(ValueError, match="op"):
        aio.Fault(op="seek")
    with pytest.raises(ValueError, match="nbytes"):
        aio.Fault(kind="short", nbytes=0)


def test_fault_errno_must_be_a_real_errno():
    with pytest.raises(ValueError, match="errno"):
        aio.Fault(kind="errno", errno=1 << 32)


def test_fault_added_while_io_runs_still_fires(backend, tmp_path):
    """A fault counts from the moment it is added, even with pieces being submitted."""
    with _faulty(backend) as h:
        running = [h.write(torch.ones(1 << 20), tmp_path / f"bg{i}") for i in range(4)]
        h.inject(aio.Fault(op="read", nth=0, kind="errno", errno=errno.EIO))
        h.write(torch.ones(10), tmp_path / "x").wait()
        with pytest.raises(aio.AIOError, match="EIO"):
            h.read(torch.empty(10), tmp_path / "x").wait(timeout=30)
        for r in running:
            r.wait(timeout=30)


def test_faults_leave_once_fired_so_a_handle_takes_any_number_over_its_life(backend, tmp_path):
    """A fault leaves the handle's list when its piece comes (the list holds 64): 100 faults
    installed one after another each fire at the next read, and the reads between them, with no
    fault installed, succeed (the unarmed path counts nothing, so "nth from now" still holds)."""
    with _faulty(backend) as h:
        t = torch.arange(1000.0)
        h.write(t, tmp_path / "x").wait()
        for _ in range(100):
            h.inject(aio.Fault(op="read", nth=1, kind="errno", errno=errno.EIO))
            out = torch.empty_like(t)
            assert h.read(out, tmp_path / "x").wait(timeout=30) == t.numel() * 4
            assert torch.equal(out, t)
            with pytest.raises(aio.AIOError, match="EIO"):
                h.read(out, tmp_path / "x").wait(timeout=30)
            h.write(t, tmp_path / "x").wait(timeout=30)  # writes count apart: never a fault
