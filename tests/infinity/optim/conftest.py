"""Fixtures shared by the swapped optimizer's tests: units in a store, and fault-injected runs."""

import errno

import pytest
import torch

import aio
from infinity.optim import UnitSpec, available_isas
from infinity.optim._native import ISAS
from infinity.store import TensorStore


def _put_units(store, dtypes, numels, seed=0):
    """Values entries at home on NVMe; returns (fp32 masters for a reference, UnitSpecs)."""
    g = torch.Generator().manual_seed(seed)
    masters, specs = [], []
    for u, (numel, dtype) in enumerate(zip(numels, dtypes)):
        values = torch.randn(numel, generator=g).to(dtype)
        store.put(f"unit{u}", values, "nvme")
        masters.append(values.float())
        specs.append(UnitSpec(numel, dtype, f"unit{u}"))
    return masters, specs


@pytest.fixture
def put_units():
    """put_units(store, dtypes, numels, seed=0) -> (fp32 masters, UnitSpecs)."""
    return _put_units


def read_back(store, key):
    """A copy of `key`'s value; the fetch is released even when its read fails."""
    future = store.fetch(key, "host")
    try:
        return future.result().clone()
    finally:
        store.release(key, "host")


def copies_in_use(store):
    return sorted(key for key, entry in store._copies.entries.items()
                  for c in entry.copies.values() if c.uses)


class FaultRun:
    """A store whose nth read or write from step `at_step` on fails once with EIO; `retried`
    calls again until success and records at which step the fault fired."""

    def __init__(self, path, op, nth, at_step, host_nbytes):
        self.op, self.nth, self.at_step = op, nth, at_step
        self.handle = aio.Handle(block_size=64 << 10)
        self.store = TensorStore({"host": host_nbytes, "nvme": 4 << 20}, nvme_path=path,
                                 aio_handle=self.handle)
        self.fired = []

    def begin(self, step):
        if step == self.at_step:
            self.handle.inject(aio.Fault(op=self.op, nth=self.nth, kind="errno", errno=errno.EIO))

    def retried(self, call, step):
        for _ in range(2):  # one fault fires once: the first retry must succeed
            try:
                return call()
            except aio.AIOError as exc:
                assert exc.errno == errno.EIO and not self.fired
                self.fired.append(step)
                assert copies_in_use(self.store) == []  # released on the failing path too
        pytest.fail("a retry failed again")

    def flushed(self, opt, step):
        """opt.flush() retried; afterwards every write-back has landed."""
        self.retried(opt.flush, step)
        assert [k for k in list(self.store._copies.entries) if self.store.unsaved(k)] == []

    def close(self):
        """The step at which the fault fired (None: never)."""
        assert copies_in_use(self.store) == []
        self.store.close()
        self.handle.close()
        return self.fired[0] if self.fired else None


@pytest.fixture
def in_use():
    """in_use(store) -> keys of copies fetched and not released."""
    return copies_in_use


@pytest.fixture
def values_of():
    """values_of(store, key) -> a copy of the entry's value."""
    return read_back


@pytest.fixture
def every_fault_position(tmp_path):
    """Run scenario(FaultRun) with the fault at read/write 0, 1, 2, ... while it fires during
    step `at_step`; returns how many positions that was."""
    def run(scenario, op, at_step, host_nbytes):
        nth = 0
        while True:
            path = tmp_path / str(nth)
            path.mkdir()
            if scenario(FaultRun(path, op, nth, at_step, host_nbytes)) != at_step:
                return nth
            nth += 1
    return run


@pytest.fixture(params=[name for name in ISAS if name != "auto"])
def isa(request) -> str:
    """Each ISA the Adam kernels have; skipped, saying so, where this CPU cannot run it."""
    if request.param not in available_isas():
        pytest.skip(f"{request.param} not supported by this CPU")
    return request.param
