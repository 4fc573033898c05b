"""SwappedOptimizer: state streamed through NVMe tiles equals in-memory CPUAdam bit for bit."""

import errno
import math

import pytest
import torch

import aio
from infinity.optim._tiles import cut_tiles
from infinity.optim.cpu_adam import CPUAdam
from infinity.optim.swapped import SwappedOptimizer
from infinity.store import TensorStore

MiB = 1 << 20
TILE = 1000  # elements: much smaller than the parameters below


def _params(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 300), (300,), (17, 33), (5000,), (1,)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


def _grads(params, step, dtype=None):
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g).to(dtype or p.dtype) for p in params]


@pytest.fixture
def store(tmp_path):
    with TensorStore({"host": 4 * 3 * 4 * TILE + (64 << 10), "nvme": 16 * MiB}, nvme_path=tmp_path,
                     aio_options={"block_size": 64 << 10}) as s:
        yield s


@pytest.mark.parametrize("adamw", [True, False])
def test_equals_in_memory_cpu_adam_bit_for_bit(store, adamw):
    ref = _params()
    ours = [p.clone() for p in ref]
    kw = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1, adamw_mode=adamw)
    opt_ref = CPUAdam(ref, **kw)
    opt = SwappedOptimizer(ours, store, tile_numel=TILE, **kw)
    assert len(opt.tiles) > 20
    for step in range(20):
        for p, q, g in zip(ref, ours, _grads(ref, step)):
            p.grad, q.grad = g, g.clone()
        opt_ref.step()
        assert opt.step().applied
        for p, q in zip(ref, ours):
            assert torch.equal(p, q), step
    for i, state in opt.iter_state():
        assert torch.equal(state["exp_avg"], opt_ref.state[ref[i]]["exp_avg"])
        assert torch.equal(state["exp_avg_sq"], opt_ref.state[ref[i]]["exp_avg_sq"])
        assert torch.equal(state["master"], ref[i])


def test_bf16_params_get_the_rounded_master(store):
    lowp = _params(1, torch.bfloat16)
    master = [p.float() for p in lowp]  # the optimizer's master starts from the bf16 values
    opt_ref = CPUAdam(master, lr=1e-3)
    opt = SwappedOptimizer(lowp, store, lr=1e-3, tile_numel=TILE)
    for step in range(5):
        grads = _grads(master, step, torch.bfloat16)
        for p, q, g in zip(master, lowp, grads):
            p.grad, q.grad = g.float(), g
        opt_ref.step()
        opt.step()
    for i, state in opt.iter_state():
        assert torch.equal(state["master"], master[i])
        assert torch.equal(lowp[i], master[i].to(torch.bfloat16))


def test_overflow_skips_the_step_without_io(store):
    params = _params(2)
    opt = SwappedOptimizer(params, store, tile_numel=TILE)
    before = [p.clone() for p in params]
    moves = store.stats()["moves"]
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    params[1].grad[7] = float("inf")
    result = opt.step(loss_scale=1024.0)
    assert not result.applied and not math.isfinite(result.grad_norm)
    assert store.stats()["moves"] == moves  # no tile was read or written
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    assert opt.steps == [0] * len(params)


def test_loss_scale_and_clipping_match_torch_clip_then_step(store):
    ref = _params(3)
    ours = [p.clone() for p in ref]
    opt_ref = CPUAdam(ref, lr=1e-2)
    opt = SwappedOptimizer(ours, store, lr=1e-2, tile_numel=TILE, max_grad_norm=0.5)
    for step in range(3):
        grads = _grads(ref, step)
        for p, q, g in zip(ref, ours, grads):
            p.grad, q.grad = g.clone(), g * 8.0  # the loss was scaled by 8
        norm = torch.nn.utils.clip_grad_norm_(ref, 0.5)
        opt_ref.step()
        result = opt.step(loss_scale=8.0)
        assert result.clip_coef < 1.0 and result.grad_norm == pytest.approx(float(norm), rel=1e-5)
        for p, q in zip(ref, ours):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_state_streams_out_and_back_in(store, tmp_path):
    params = _params(4)
    opt = SwappedOptimizer(params, store, tile_numel=TILE, lr=1e-2)
    for step in range(3):
        for p, g in zip(params, _grads(params, step)):
            p.grad = g
        opt.step()
    saved = [(i, {k: (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()})
             for i, s in opt.iter_state()]
    twin_params = [p.clone() for p in params]
    with TensorStore({"host": 4 * 3 * 4 * TILE + (64 << 10), "nvme": 16 * MiB}, nvme_path=tmp_path) as other:
        twin = SwappedOptimizer(twin_params, other, tile_numel=2 * TILE + 7, lr=1e-2)  # other tiling
        twin.load_state(saved)
        for step in range(3, 6):
            grads = _grads(params, step)
            for p, q, g in zip(params, twin_params, grads):
                p.grad, q.grad = g, g.clone()
            opt.step()
            twin.step()
            for p, q in zip(params, twin_params):
                assert torch.equal(p, q)


def test_state_dict_round_trips_with_torch_adamw(store):
    params = _params(5)
    opt = SwappedOptimizer(params, store, tile_numel=TILE, lr=1e-2)
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    opt.step()
    torch_params = [p.clone().requires_grad_() for p in params]
    torch_opt = torch.optim.AdamW(torch_params, lr=1e-2, weight_decay=0.0)
    torch_opt.load_state_dict(opt.state_dict())
    for p, q, g in zip(params, torch_params, _grads(params, 1)):
        p.grad, q.grad = g, g.clone()
    opt.step()
    torch_opt.step()
    for p, q in zip(params, torch_params):
        torch.testing.assert_close(p, q.detach(), rtol=1e-6, atol=1e-7)
    opt.load_state_dict(torch_opt.state_dict())
    assert all(s["step"] == 2 for _, s in opt.iter_state())


def test_host_memory_stays_within_the_tile_budget(tmp_path):
    """State of 48 MB streams through a 4-tile host budget: peak RSS grows by far less."""
    params = [torch.zeros(1 << 20) for _ in range(4)]  # 4M params: 48 MB of state on NVMe
    for p in params:
        p.grad = torch.full_like(p, 0.5)
    tile = 1 << 18  # 3 MB per tile
    budget = 4 * 3 * 4 * tile
    with TensorStore({"host": budget, "nvme": 64 * MiB}, nvme_path=tmp_path) as store:
        opt = SwappedOptimizer(params, store, tile_numel=tile)
        opt.step()  # warm up: the arena's pages are touched
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak RSS (VmHWM)
        base = _rss_kib("VmRSS")
        for _ in range(2):
            opt.step()
        grown = (_rss_kib("VmHWM") - base) * 1024
    assert grown < 16 * MiB, f"peak RSS grew by {grown} bytes during steps over 48 MB of state"


def _rss_kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def test_write_back_error_is_raised(tmp_path):
    handle = aio.Handle(block_size=64 << 10)
    with TensorStore({"host": 4 * 3 * 4 * TILE + (64 << 10), "nvme": 16 * MiB}, nvme_path=tmp_path,
                     aio_handle=handle) as store:
        params = _params(6)
        opt = SwappedOptimizer(params, store, tile_numel=TILE)
        for p, g in zip(params, _grads(params, 0)):
            p.grad = g
        handle.inject(aio.Fault(op="write", nth=3, kind="errno", errno=errno.EIO))
        with pytest.raises(aio.AIOError, match="EIO"):
            opt.step()
            store.flush()
    handle.close()


def test_bad_input(store):
    with pytest.raises(ValueError, match="no parameters"):
        SwappedOptimizer([], store)
    with pytest.raises(ValueError, match="dtype torch.int64"):
        SwappedOptimizer([torch.ones(3, dtype=torch.int64)], store)
    with pytest.raises(ValueError, match="contiguous"):
        SwappedOptimizer([torch.ones(4, 4).t()], store)
    with pytest.raises(ValueError, match="at least 3 optimizer tiles"):
        SwappedOptimizer([torch.ones(10_000_000)], store, tile_numel=1 << 20)
    with pytest.raises(ValueError, match="Invalid beta parameter at index 1"):
        SwappedOptimizer([torch.ones(10)], store, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="threads"):
        SwappedOptimizer([torch.ones(10)], store, threads=0)
    opt = SwappedOptimizer([torch.ones(10)], store, name="small")
    with pytest.raises(ValueError, match="in order"):
        opt.load_state([(1, {})])


def test_tiles_cover_every_element_once():
    tiles = cut_tiles([5, 0, 12, 3], 4)
    seen = [(s.param, s.param_offset + k) for t in tiles for s in t for k in range(s.numel)]
    assert sorted(seen) == [(0, k) for k in range(5)] + [(2, k) for k in range(12)] + [(3, k) for k in range(3)]
    assert all(sum(s.numel for s in t) <= 4 for t in tiles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parameters_living_in_the_store(tmp_path, dtype):
    """Values in store entries (home NVMe) get the same updates as host parameters, and a
    parameter spanning many tiles is read and written once per step."""
    host = _params(7, dtype)
    shadow = [torch.empty_like(p) for p in host]  # shapes and grads only
    with TensorStore({"host": 1 * MiB, "nvme": 32 * MiB}, nvme_path=tmp_path) as store:
        keys = [f"param{i}" for i in range(len(host))]
        for key, p in zip(keys, host):
            store.put(key, p, "nvme")
        ref = SwappedOptimizer(host, store, tile_numel=TILE, lr=1e-2, name="ref")
        opt = SwappedOptimizer(shadow, store, tile_numel=TILE, lr=1e-2, param_keys=keys, name="opt")
        for step in range(3):
            for p, q, g in zip(host, shadow, _grads(host, step)):
                p.grad, q.grad = g, g.clone()
            store.moves._events.clear()
            ref.step()
            opt.step()
            store.flush()
            writes = [e[0] for e in store.moves._events if e[0] == "param0" and e[2].label == "nvme"]
            assert len(writes) == 1  # param0 spans 20 tiles, written back once
        for key, p in zip(keys, host):
            assert torch.equal(store.fetch(key, "host").result(), p)
            store.release(key, "host")


def test_state_dict_is_lazy_and_complete(store):
    params = _params(8)
    opt = SwappedOptimizer(params, store, tile_numel=TILE)
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    params[3].grad = None  # never stepped: absent, as in torch
    opt.step()
    state = opt.state_dict()["state"]
    assert not isinstance(state, dict) and len(state) == len(params) - 1 and 3 not in state
    assert sorted(state) == [0, 1, 2, 4]
    assert state[0]["exp_avg"].shape == params[0].shape and float(state[0]["step"]) == 1.0
    with pytest.raises(KeyError):
        state[3]


@pytest.mark.parametrize("scale", [0, 0.0, -1.0, float("nan"), float("inf"), "8"])
def test_loss_scale_must_be_finite_and_positive(store, scale):
    params = _params(9)
    opt = SwappedOptimizer(params, store, tile_numel=TILE)
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    before = [p.clone() for p in params]
    with pytest.raises(ValueError, match="loss_scale must be a finite number > 0"):
        opt.step(loss_scale=scale)
    assert all(torch.equal(p, b) for p, b in zip(params, before)) and opt.completed_steps == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype, loss_scale, level", [
    (torch.float32, 1.0, "WARNING"),  # fp32 / bf16: a warning and a count
    (torch.bfloat16, 1.0, "WARNING"),
    (torch.float16, 1024.0, "INFO"),  # fp16 with a loss scaler: a routine overflow
])
def test_non_finite_gradients_skip_the_step(store, caplog, bad, dtype, loss_scale, level):
    params = _params(10, dtype)
    opt = SwappedOptimizer(params, store, tile_numel=TILE)
    before = [p.clone() for p in params]
    moves = store.stats()["moves"]
    for p, g in zip(params, _grads(params, 0)):
        p.grad = g
    params[3].grad[17] = bad
    with caplog.at_level("INFO", logger="infinity.optim.swapped"):
        result = opt.step(loss_scale=loss_scale)
    assert not result.applied and not math.isfinite(result.grad_norm)
    assert opt.skipped_steps == 1 and opt.completed_steps == 0 and opt.steps == [0] * len(params)
    assert [r.levelname for r in caplog.records] == [level]
    assert "skipped" in caplog.records[0].getMessage()
    assert store.stats()["moves"] == moves  # no tile was read or written
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    params[3].grad[17] = 0.0
    assert opt.step(loss_scale=loss_scale).applied and opt.completed_steps == 1
    assert opt.skipped_steps == 1


def test_state_on_the_host_tier_without_nvme():
    ref = _params(11)
    ours = [p.clone() for p in ref]
    with TensorStore({"host": 1 * MiB}) as host_only:
        opt_ref = CPUAdam(ref, lr=1e-2)
        opt = SwappedOptimizer(ours, host_only, lr=1e-2, tile_numel=TILE, state_tier="host")
        for step in range(3):
            for p, q, g in zip(ref, ours, _grads(ref, step)):
                p.grad, q.grad = g, g.clone()
            opt_ref.step()
            assert opt.step().applied
        assert all(torch.equal(p, q) for p, q in zip(ref, ours))
        assert host_only.tiers_of(opt._key(0)) == ["host"]
        with pytest.raises(ValueError, match="state_tier must be"):
            SwappedOptimizer(ours, host_only, state_tier="device", name="d")
