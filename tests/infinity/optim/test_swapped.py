"""SwappedOptimizer: state streamed through NVMe tiles equals in-memory CPUAdam bit for bit, holds
a few tiles in memory whatever the state's size, and moves no byte for a refused gradient."""

import errno

import pytest
import torch

import aio
from infinity.optim import CPUAdam, SwappedOptimizer, UnitSpec
from infinity.optim._tiles import cut_units
from infinity.store import TensorStore

MiB = 1 << 20
TILE = 1000  # elements: much smaller than the units below
NUMELS = [64 * 300, 300, 17 * 33, 5000, 1]  # the largest unit's values (77 KB) fit the host


def _grads(numels, step, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(n, generator=g).to(dtype) for n in numels]


@pytest.fixture
def store(tmp_path):
    with TensorStore({"host": 4 * 3 * 4 * TILE + (64 << 10), "nvme": 16 * MiB}, nvme_path=tmp_path,
                     aio_options={"block_size": 64 << 10}) as s:
        yield s


def _units(store, numels, dtype=torch.float32, seed=0):
    """Values entries at home on NVMe; returns (their fp32 values for a reference, UnitSpecs)."""
    g = torch.Generator().manual_seed(seed)
    values, specs = [], []
    for u, numel in enumerate(numels):
        v = torch.randn(numel, generator=g).to(dtype)
        store.put(f"unit{u}", v, "nvme")
        values.append(v.float())
        specs.append(UnitSpec(numel, dtype, f"unit{u}"))
    return values, specs


def _step(opt, grads):
    for u, g in enumerate(grads):
        opt.step_unit(u, g)
    opt.finish_step()


@pytest.mark.parametrize("adamw", [True, False])
def test_equals_in_memory_cpu_adam_bit_for_bit(store, adamw, values_of):
    ref, specs = _units(store, NUMELS)
    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1, adamw_mode=adamw)
    opt_ref = CPUAdam(ref, **kw)
    opt = SwappedOptimizer(specs, store, tile_numel=TILE, **kw)
    assert len(opt.tiles) > 20
    for step in range(20):
        grads = _grads(NUMELS, step)
        for p, g in zip(ref, grads):
            p.grad = g
        opt_ref.step()
        _step(opt, grads)
        for u, p in enumerate(ref):
            assert torch.equal(values_of(store, f"unit{u}"), p), step
    for u, state in opt.iter_state():
        assert torch.equal(state["exp_avg"], opt_ref.state[ref[u]]["exp_avg"])
        assert torch.equal(state["exp_avg_sq"], opt_ref.state[ref[u]]["exp_avg_sq"])
        assert torch.equal(state["master"], ref[u])


def test_a_non_finite_gradient_is_refused_without_io(store, values_of):
    before, specs = _units(store, NUMELS, seed=2)
    opt = SwappedOptimizer(specs, store, tile_numel=TILE)
    moves = store.stats()["moves"]
    grad = _grads(NUMELS, 0)[3]
    grad[7] = float("inf")
    with pytest.raises(ValueError, match="unit 3's gradient has non-finite values"):
        opt.step_unit(3, grad)
    assert store.stats()["moves"] == moves  # no tile or value was read or written
    assert opt.tiles.steps == [0] * len(opt.tiles)
    assert all(torch.equal(values_of(store, s.values_key), b) for s, b in zip(specs, before))


def test_host_memory_stays_within_the_tile_budget(tmp_path):
    """State of 48 MB (bf16 units: master and moments in the tiles) streams through a host tier
    of 4 tiles and one unit's values: peak RSS grows by far less."""
    numel, tile = 1 << 20, 1 << 18  # 4 units of 1M: 12 MB of state each, tiles of 3 MB
    budget = 4 * 12 * tile + 2 * numel + MiB
    with TensorStore({"host": budget, "nvme": 64 * MiB}, nvme_path=tmp_path) as store:
        _, specs = _units(store, [numel] * 4, torch.bfloat16)
        grads = [torch.full((numel,), 0.5, dtype=torch.bfloat16) for _ in specs]
        opt = SwappedOptimizer(specs, store, tile_numel=tile)
        _step(opt, grads)  # warm up: the arena's pages are touched
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM)
        base = _rss_kib("VmRSS")
        for _ in range(2):
            _step(opt, grads)
        grown = (_rss_kib("VmHWM") - base) * 1024
    assert grown < 16 * MiB, f"peak RSS grew by {grown} bytes during steps over 48 MB of state"


def _rss_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_write_back_error_is_raised(tmp_path):
    handle = aio.Handle(block_size=64 << 10)
    with TensorStore({"host": 4 * 3 * 4 * TILE + (64 << 10), "nvme": 16 * MiB}, nvme_path=tmp_path,
                     aio_handle=handle) as store:
        _, specs = _units(store, NUMELS, seed=6)
        opt = SwappedOptimizer(specs, store, tile_numel=TILE)
        handle.inject(aio.Fault(op="write", nth=3, kind="errno", errno=errno.EIO))
        with pytest.raises(aio.AIOError, match="EIO"):
            _step(opt, _grads(NUMELS, 0))
            store.flush()
    handle.close()


def test_bad_input(store):
    _, specs = _units(store, [10, 3 << 14])
    with pytest.raises(ValueError, match="at least 3 optimizer tiles"):  # of 128 KiB each
        SwappedOptimizer(specs[1:], store, tile_numel=1 << 14)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        SwappedOptimizer(specs[:1], store, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="threads"):
        SwappedOptimizer(specs[:1], store, threads=0)
    with pytest.raises(ValueError, match="tile_numel must be an int >= 1"):
        SwappedOptimizer(specs[:1], store, tile_numel=0)
    with pytest.raises(ValueError, match="state_tier must be"):
        SwappedOptimizer(specs[:1], store, state_tier="device")
    opt = SwappedOptimizer(specs[:1], store, name="small")
    with pytest.raises(ValueError, match="in order"):
        opt.load_state([(1, {})])
    with pytest.raises(ValueError,
                       match=r"unit 0: state 'exp_avg' has shape \(9,\), expected \(10,\)"):
        opt.load_state([(0, {"step": 1, "master": torch.ones(10), "exp_avg": torch.ones(9),
                             "exp_avg_sq": torch.ones(10)})])


def test_tiles_cover_every_element_once():
    tiles = cut_units([5, 12, 3], 4)
    seen = [(t.unit, t.start + k) for t in tiles for k in range(t.numel)]
    assert seen == ([(0, k) for k in range(5)] + [(1, k) for k in range(12)]
                    + [(2, k) for k in range(3)])
    assert all(0 < t.numel <= 4 for t in tiles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_spanning_many_tiles_are_read_and_written_once_per_step(tmp_path, dtype, values_of):
    """A unit's values entry (home NVMe) spanning 20 tiles is fetched once for all of them and
    written back once per step."""
    with TensorStore({"host": 1 * MiB, "nvme": 32 * MiB}, nvme_path=tmp_path) as store:
        master, specs = _units(store, [20 * TILE], dtype, seed=7)
        opt_ref = CPUAdam(master, lr=1e-2)
        opt = SwappedOptimizer(specs, store, tile_numel=TILE, lr=1e-2)
        for step in range(3):
            grads = _grads([20 * TILE], step, dtype)
            master[0].grad = grads[0].float()
            opt_ref.step()
            store.moves._events.clear()
            _step(opt, grads)
            store.flush()
            moves = [(e[1].label, e[2].label) for e in store.moves._events if e[0] == "unit0"]
            assert moves.count(("host", "nvme")) == 1 and moves.count(("nvme", "host")) <= 1
        assert torch.equal(values_of(store, "unit0"), master[0].to(dtype))
