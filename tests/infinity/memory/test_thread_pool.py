"""ThreadPool: persistent kernel workers, reused across calls and shared between threads."""

import textwrap
import threading

import pytest
import torch
from children import python_child

from infinity.errors import ClosedError
from infinity.memory import ThreadPool
from infinity.memory._move import move_down
from infinity.optim import adam_step

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01, "adamw": True}
N = 4 * 65536 + 123  # enough elements for four threads, and a ragged tail


def _state(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(N, generator=g), torch.randn(N, generator=g), torch.zeros(N),
            torch.zeros(N)]


def _steps(state: list[torch.Tensor], steps: int, **kw) -> list[torch.Tensor]:
    for step in range(1, steps + 1):
        adam_step(*state, step=step, **HYPER, **kw)
    return state


def test_a_reused_pool_gives_the_calling_threads_result_bit_for_bit():
    want = _steps(_state(0), 20, threads=1)
    with ThreadPool(4) as pool:
        got = _steps(_state(0), 20, pool=pool)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_threads_sharing_one_pool_take_turns_and_stay_correct():
    want = [_steps(_state(seed), 10, threads=1) for seed in range(4)]
    got: list = [None] * 4
    errors: list[BaseException] = []
    with ThreadPool(3) as pool:
        def work(seed: int) -> None:
            try:
                got[seed] = _steps(_state(seed), 10, pool=pool)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
        threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not any(t.is_alive() for t in threads), "a kernel call on a shared pool hung"
    assert not errors, errors
    for seed in range(4):
        for a, b in zip(got[seed], want[seed]):
            assert torch.equal(a, b), f"seed {seed}"


def test_compaction_moves_run_on_a_reused_pool():
    base = torch.randint(0, 256, (24 << 20,), dtype=torch.uint8)
    want = base.clone()
    moves = [(0, 4 << 20, 6 << 20), (6 << 20, 12 << 20, 8 << 20)]
    for dst, src, n in moves:
        want[dst:dst + n] = want[src:src + n].clone()
    with ThreadPool(4) as pool:
        for _ in range(3):  # the same pool for every call
            got = base.clone()
            move_down(got, *([m[i] for m in moves] for i in range(3)), pool=pool)
            assert torch.equal(got, want)


def test_a_one_thread_pool_and_threads_below_the_pool_size_work():
    want = _steps(_state(1), 3, threads=1)
    with ThreadPool(1) as one, ThreadPool(4) as four:
        assert torch.equal(_steps(_state(1), 3, pool=one)[0], want[0])
        assert torch.equal(_steps(_state(1), 3, pool=four, threads=2)[0], want[0])


@pytest.mark.parametrize("threads", [0, -1, 1.5, True])
def test_bad_thread_counts_are_refused(threads):
    with pytest.raises(ValueError, match="threads must be an int >= 1"):
        ThreadPool(threads)


def test_a_closed_pool_is_refused_and_closing_twice_is_harmless():
    pool = ThreadPool(2)
    pool.close()
    pool.close()
    assert "closed" in repr(pool)
    with pytest.raises(ClosedError, match="ThreadPool is closed"):  # a ValueError, as before
        _steps(_state(2), 1, pool=pool)


def test_workers_are_joined_on_close():
    before = threading.active_count()
    native_before = _native_threads()
    pool = ThreadPool(4)
    assert _native_threads() == native_before + 3
    pool.close()
    assert _native_threads() == native_before
    assert threading.active_count() == before


def _native_threads() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))


def test_a_forked_child_refuses_its_parents_pool_and_exits():
    """os.fork() copies a pool but not its workers: the child's kernels are refused the pool by
    name, and its close() and exit do not wait for workers to join (they hung); the parent's
    pool goes on working."""
    code = textwrap.dedent("""
        import faulthandler, os, sys, torch
        from infinity.memory import ThreadPool
        from infinity.optim import adam_step
        pool = ThreadPool(2)
        n = 1 << 16
        state = [torch.ones(n), torch.ones(n), torch.zeros(n), torch.zeros(n)]
        hyper = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
        pid = os.fork()
        if pid == 0:
            faulthandler.dump_traceback_later(30, exit=True)  # a hung child ends itself
            try:
                adam_step(*state, step=1, pool=pool, **hyper)
            except Exception as e:
                print("child:", type(e).__name__, e, flush=True)
            pool.close()
            sys.exit(0)
        print("child exit", os.waitpid(pid, 0)[1], flush=True)
        adam_step(*state, step=1, pool=pool, **hyper)
        pool.close()
        print("parent stepped", bool((state[0] < 1).all()))
    """)
    out = python_child(["-c", code], timeout=90)
    assert out.returncode == 0, out.stderr
    assert "child: ClosedError ThreadPool of process" in out.stdout, out.stdout
    assert "inherited through fork()" in out.stdout
    assert "child exit 0" in out.stdout and "parent stepped True" in out.stdout
