"""Round trips, integrity under concurrency, and the errors callers see."""

import errno
import hashlib
import os
import random
import textwrap
import threading

import numpy as np
import pytest
import torch
from children import python_child

import aio

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8, torch.bool,
          torch.float64, torch.int32]


def _random_tensor(rng: random.Random, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    raw = torch.randint(0, 256, (numel * torch.empty((), dtype=dtype).element_size(),),
                        dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw & 1).bool()
    return raw.view(dtype)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def test_round_trip_every_backend(handle, tmp_path):
    t = torch.randn(1_000_003)
    path = tmp_path / "t.bin"
    assert handle.write(t, path).wait() == t.numel() * 4
    out = torch.empty_like(t)
    assert handle.read(out, path).wait() == t.numel() * 4
    assert torch.equal(t, out)


def test_random_integrity_concurrent(handle, tmp_path):
    """Thousands of writes and reads of random sizes, offsets and dtypes, many in flight."""
    rng = random.Random(1234)
    files = [tmp_path / f"f{i}" for i in range(4)]
    written = []  # (path, offset, tensor, digest)
    cursor = {f: 0 for f in files}
    requests = []
    for i in range(1500):
        dtype = rng.choice(DTYPES)
        numel = rng.choice([1, 3, 511, 1024, 4097,
                            rng.randrange(1, 40_000), rng.randrange(1, 300_000)])
        t = _random_tensor(rng, numel, dtype)
        f = rng.choice(files)
        # aligned or deliberately unaligned offsets; regions never overlap
        offset = cursor[f] + rng.choice([0, 0, 1, 511, 4096, rng.randrange(0, 9000)])
        nbytes = t.numel() * t.element_size()
        cursor[f] = offset + nbytes
        requests.append(handle.write(t, f, offset))
        written.append((f, offset, t, _digest(t)))
        if i % 97 == 0:  # let some complete while others are still being submitted
            requests.pop(0).wait()
    for r in requests:
        r.wait()
    rng.shuffle(written)
    reads = []
    for f, offset, t, digest in written:
        out = torch.empty_like(t)
        reads.append((handle.read(out, f, offset), out, digest, t))
    for r, out, digest, t in reads:
        assert r.wait() == t.numel() * t.element_size()
        assert _digest(out) == digest


def test_unaligned_buffer_and_length(handle, tmp_path):
    base = aio.aligned_empty(3 * 4096 + 64)
    base.copy_(torch.randint(0, 256, base.shape, dtype=torch.uint8))
    view = base[1 : 1 + 10_001]  # address off by one, odd length
    path = tmp_path / "u.bin"
    handle.write(view, path, offset=4096).wait()
    out = torch.zeros(10_001, dtype=torch.uint8)
    handle.read(out, path, offset=4096).wait()
    assert torch.equal(out, view)
    assert os.path.getsize(path) == 4096 + 10_001  # nothing padded, nothing lost


def test_zero_length_request_is_done_at_once(handle, tmp_path):
    r = handle.write(torch.empty(0), tmp_path / "z.bin")
    assert r.done() and r.wait() == 0


class _SlowNative:
    """A native layer whose one request finishes when `landed` is set (no I/O)."""

    def __init__(self):
        self.landed = threading.Event()

    def done(self, native):
        return self.landed.is_set()

    def wait(self, native, timeout_ns):
        if not self.landed.wait(None if timeout_ns < 0 else timeout_ns / 1e9):
            return None
        return type("Status", (), {"error": 0, "nbytes_done": 8})()

    def free(self, native):
        pass


def test_done_does_not_wait_for_a_thread_in_wait():
    """done() never blocks: the store polls it under its lock while the optimizer's worker
    waits for the same read; blocking there stalled the training thread for the transfer."""
    native = _SlowNative()
    handle = type("FakeHandle", (), {"_native": native, "_finished": lambda self, r: None})()
    request = aio.Request(handle, object(), bytearray(8), None, "read", "f", 0, 8)
    waiter = threading.Thread(target=request.wait)
    waiter.start()
    try:
        while not request._lock.locked():  # the waiter is inside wait(), holding the lock
            pass
        answered = []
        poller = threading.Thread(target=lambda: answered.append(request.done()))
        poller.start()
        poller.join(timeout=5)
        assert answered == [False]
    finally:
        native.landed.set()
        waiter.join()
    assert request.done() and request.wait() == 8


def test_numpy_and_bytes_buffers(handle, tmp_path):
    a = np.arange(10_000, dtype=np.float64)
    handle.write(a, tmp_path / "a.bin").wait()
    b = np.empty_like(a)
    handle.read(b, tmp_path / "a.bin").wait()
    np.testing.assert_array_equal(a, b)
    handle.write(b"hello world", tmp_path / "b.bin").wait()
    out = bytearray(11)
    handle.read(out, tmp_path / "b.bin").wait()
    assert out == b"hello world"
    with pytest.raises(ValueError, match="read-only"):
        handle.read(b"immutable", tmp_path / "b.bin")


def test_missing_file_read_names_path(handle, tmp_path):
    path = tmp_path / "missing.bin"
    with pytest.raises(aio.AIOError) as info:
        handle.read(torch.empty(10), path)
    assert info.value.errno == 2 and str(path) in str(info.value)


def test_missing_directory_write(handle, tmp_path):
    with pytest.raises(aio.AIOError, match="No such file"):
        handle.write(torch.ones(4), tmp_path / "nodir" / "x.bin")


def test_read_past_end_of_file(handle, tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 5000)
    out = torch.empty(8192, dtype=torch.uint8)
    with pytest.raises(aio.AIOError) as info:
        handle.read(out, path).wait()
    err = info.value
    assert err.errno == 61 and "end of file" in str(err) and "5000" in str(err)
    assert err.offset == 5000 and err.nbytes == 8192 - 5000


def test_directory_is_not_a_file(handle, tmp_path):
    with pytest.raises(aio.AIOError, match="Is a directory|not a regular file"):
        handle.read(torch.empty(4), tmp_path)


def test_bad_arguments(handle, tmp_path):
    with pytest.raises(ValueError, match="contiguous"):
        handle.write(torch.ones(4, 4).t(), tmp_path / "x")
    with pytest.raises(ValueError, match="offset"):
        handle.write(torch.ones(4), tmp_path / "x", offset=-1)
    with pytest.raises(TypeError, match="torch.Tensor, numpy.ndarray or buffer"):
        handle.write(object(), tmp_path / "x")
    with pytest.raises(TypeError, match="host memory"):
        handle.write(torch.ones(4, device="meta"), tmp_path / "x")
    with pytest.raises(ValueError, match="block_size"):
        aio.Handle(block_size=1000)
    with pytest.raises(ValueError, match="backend"):
        aio.Handle(backend="spdk")


@pytest.mark.requires_cuda
def test_cuda_tensor_is_refused(handle, tmp_path):
    with pytest.raises(TypeError, match="cuda"):
        handle.write(torch.ones(4, device="cuda"), tmp_path / "x")


def test_closed_handle_refuses_io(tmp_path):
    h = aio.Handle()
    h.close()
    h.close()  # idempotent
    with pytest.raises(ValueError, match="closed"):
        h.write(torch.ones(4), tmp_path / "x")


def test_a_handle_left_open_is_closed_at_exit_without_a_traceback(tmp_path):
    """A handle nobody closed, held where the interpreter tears it down after aio's own modules
    (here a global of `os`), is closed at exit by aio's exit hook, its write waited for, and
    leaves no "Exception ignored" traceback (its __del__ would find `_native` gone)."""
    code = textwrap.dedent(f"""
        import atexit, os
        atexit.register(lambda: print("closed at exit:", os._h._closed))  # runs after aio's hook
        import torch, aio
        os._h = aio.Handle()
        os._h.write(torch.ones(1 << 18), {str(tmp_path / "f")!r})
    """)
    out = python_child(["-c", code], timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.strip() == "closed at exit: True"
    assert (tmp_path / "f").stat().st_size == 1 << 20


def test_a_forked_child_refuses_its_parents_handle_and_exits(tmp_path):
    """os.fork() copies a handle but not its engine's threads: the child's I/O on it is refused
    by name, its close() and its exit do not wait for threads it does not have (they hung), and
    the parent's handle goes on working."""
    code = textwrap.dedent(f"""
        import faulthandler, os, sys, torch, aio
        h = aio.Handle()
        path = {str(tmp_path / "f")!r}
        h.write(torch.ones(1024), path).wait()
        pid = os.fork()
        if pid == 0:
            faulthandler.dump_traceback_later(30, exit=True)  # a hung child ends itself
            try:
                h.write(torch.ones(1024), path)
            except ValueError as e:
                print("child:", e, flush=True)
            h.close()
            sys.exit(0)
        print("child exit", os.waitpid(pid, 0)[1], flush=True)
        h.write(torch.ones(1024), path, offset=4096).wait()
        h.close()
        print("parent wrote", os.path.getsize(path))
    """)
    out = python_child(["-c", code], timeout=90)
    assert out.returncode == 0, out.stderr
    assert "aio.Handle of process" in out.stdout and "inherited through fork()" in out.stdout
    assert "child exit 0" in out.stdout and "parent wrote 8192" in out.stdout, out.stdout


def test_wait_all_returns_total(handle, tmp_path):
    for i in range(10):
        handle.write(torch.ones(1000), tmp_path / "w.bin", offset=i * 4000)
    assert handle.wait_all(timeout=30) == 10 * 4000


def test_file_replaced_behind_the_handle_is_reopened(handle, tmp_path):
    path = tmp_path / "r.bin"
    handle.write(torch.full((1024,), 1.0), path).wait()
    os.unlink(path)
    handle.write(torch.full((1024,), 2.0), path).wait()
    out = torch.empty(1024)
    handle.read(out, path).wait()
    assert torch.all(out == 2.0)


def test_read_only_directory(read_only_dir, run_unprivileged):
    """A directory the process may not write into gives EACCES naming the path."""
    target = os.path.join(read_only_dir, "x.bin")
    out = run_unprivileged(textwrap.dedent(f"""
        import torch
        try:
            with aio.Handle() as h:
                h.write(torch.ones(4), {target!r}).wait()
        except aio.AIOError as e:
            print("ERR", e.errno, e)
            sys.exit(0)
        sys.exit(1)
    """))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ERR 13" in out.stdout and target in out.stdout and "open for write" in out.stdout


def test_offset_near_the_limit_fails_fast(handle, tmp_path):
    """Offsets whose end would overflow 64 bits are refused or fail, never hang."""
    path = tmp_path / "x"
    path.write_bytes(b"0" * 10)
    with pytest.raises((aio.AIOError, ValueError)):
        handle.read(bytearray(10), path, 2**63 - 11).wait(timeout=10)
    with pytest.raises((aio.AIOError, ValueError, OverflowError)):
        handle.read(bytearray(10), path, 2**63 - 5).wait(timeout=10)


def test_close_racing_submitters_never_crashes(backend, tmp_path):
    """Requests submitted while other threads close are refused, finish, or fail ECANCELED;
    no submitter crashes, hangs or loses a request.

    Each round, every submitter has submitted and one request has completed before the closers
    start; one request is stuck on an injected hang, so close() must cancel it. Submitters go
    on until refused.
    """
    submitters, nbytes = 3, 256 << 10
    for round_ in range(5):
        h = aio.Handle(backend=backend, block_size=64 << 10,
                       faults=[aio.Fault(op="write", nth=1, kind="hang")])
        outcomes, crashes = [], []
        submitted = [threading.Event() for _ in range(submitters)]
        completed = threading.Event()

        def submit(i, h=h, outcomes=outcomes, crashes=crashes, submitted=submitted,
                   completed=completed):
            buf = torch.ones(nbytes // 4)
            try:
                for _ in range(100_000):  # bounded: close() must refuse well before
                    try:
                        r = h.write(buf, tmp_path / f"c{i}")
                    except ValueError:  # the handle is closed
                        outcomes.append("refused")
                        return
                    submitted[i].set()
                    try:
                        outcomes.append(r.wait(timeout=30))
                        completed.set()
                    except aio.AIOError as exc:
                        outcomes.append(exc.errno)
                crashes.append(f"submitter {i} was never refused")
            except BaseException as exc:  # anything else is a crash
                crashes.append(f"submitter {i}: {exc!r}")

        threads = [threading.Thread(target=submit, args=(i,)) for i in range(submitters)]
        for t in threads:
            t.start()
        assert all(e.wait(timeout=30) for e in submitted), "a submitter never submitted"
        assert completed.wait(timeout=30), "no request completed before close"
        def close(h=h, crashes=crashes):
            try:
                h.close()
            except BaseException as exc:  # close() must not raise here
                crashes.append(f"close: {exc!r}")

        closers = [threading.Thread(target=close) for _ in range(2)]
        for t in closers:
            t.start()
        for t in closers + threads:
            t.join(timeout=60)
        hung = [t.name for t in closers + threads if t.is_alive()]
        assert not hung, f"round {round_}: threads still running after 60 s: {hung}"
        assert not crashes, f"round {round_}: " + "; ".join(crashes)
        unexpected = [o for o in outcomes if o not in (nbytes, errno.ECANCELED, "refused")]
        assert not unexpected, f"round {round_}: unexpected outcomes {unexpected}"
        assert outcomes.count("refused") == submitters, outcomes  # each ends refused
        assert nbytes in outcomes and errno.ECANCELED in outcomes, outcomes
