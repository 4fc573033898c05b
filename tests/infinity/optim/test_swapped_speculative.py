"""Speculative steps (issue 22; [Note: speculative steps] in infinity/optim/_kept.py): a unit
stepped speculatively and committed equals the plain step bit for bit; rolled back, it is as
before the step (tiles, values, step record) and a redo with another gradient scale equals that
step taken plainly; without room to keep the old state nothing changes and step_unit says so."""

import errno

import pytest
import torch

import aio
from infinity.optim import CPUAdam, SwappedOptimizer, UnitSpec
from infinity.store import TensorStore, Tier

MiB = 1 << 20
TILE = 1000
NUMELS = [2500, 7, 1000]
HYPER = dict(lr=1e-2, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1)


def _grads(specs, step):
    g = torch.Generator().manual_seed(200 + step)
    return [torch.randn(s.numel, generator=g).to(s.dtype) for s in specs]


def _state(opt):
    return [(u, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()})
            for u, s in opt.iter_state()]


def _equal_states(a, b):
    return all(ua == ub and sa.keys() == sb.keys() and
               all(torch.equal(sa[k], sb[k]) if isinstance(sa[k], torch.Tensor) else sa[k] == sb[k]
                   for k in sa)
               for (ua, sa), (ub, sb) in zip(a, b, strict=True))


def _keys(store):
    return set(store._copies.entries)


def _kept(store, keys):
    """What the store holds of the old state: entries it keeps, and entries put aside."""
    return store.stats()["kept"]["entries"] + len(_keys(store) - keys)


@pytest.mark.parametrize("tier", [Tier.NVME, Tier.HOST])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_commit_keeps_and_rollback_undoes_a_speculative_step(tmp_path, put_units, values_of,
                                                             tier, dtype):
    with TensorStore({"host": 4 * MiB, "nvme": 8 * MiB}, nvme_path=tmp_path,
                     aio_options={"block_size": 64 << 10}) as store:
        masters, specs = put_units(store, [dtype] * len(NUMELS), NUMELS)
        opt_ref = CPUAdam(masters, **HYPER)
        opt = SwappedOptimizer(specs, store, tile_numel=TILE, state_tier=tier, **HYPER)
        keys = _keys(store)
        for step, scale in enumerate([1.0, 0.25, 1.0]):  # 0.25: "clipping acts" at step 1
            grads = _grads(specs, step)
            before = _state(opt)
            for u in range(len(specs)):
                assert opt.step_unit(u, grads[u], speculative=True)
            assert _kept(store, keys) > 0  # the old state is kept beside the new
            if scale != 1.0:
                for u in range(len(specs)):
                    opt.rollback_unit(u)
                assert _equal_states(_state(opt), before)
                for u, spec in enumerate(specs):  # the values too, not only the fp32 master
                    assert torch.equal(values_of(store, spec.values_key), before[u][1]["master"]
                                       .to(dtype))
                for u in range(len(specs)):
                    opt.step_unit(u, grads[u], grad_scale=scale)
            else:
                for u in range(len(specs)):
                    opt.commit_unit(u)
            opt.finish_step()
            assert _keys(store) == keys and _kept(store, keys) == 0  # nothing kept once decided
            for m, g in zip(masters, grads):
                m.grad = g.float() * scale
            opt_ref.step()
        for (u, state), master, spec in zip(opt.iter_state(), masters, specs):
            assert state["step"] == 3
            assert torch.equal(state["master"], master), u
            assert torch.equal(state["exp_avg"], opt_ref.state[master]["exp_avg"]), u
            assert torch.equal(state["exp_avg_sq"], opt_ref.state[master]["exp_avg_sq"]), u
            assert torch.equal(values_of(store, spec.values_key), master.to(dtype)), u


def test_no_room_to_keep_the_old_state_changes_nothing(tmp_path):
    """Everything in RAM (no NVMe to spill to) with a host budget that holds the state, the
    values and their kept copy, and new versions of 2 of the 4 tiles: the third fails after
    the values of the first two changed; step_unit returns False with the unit as it was."""
    numel, block = 4 * TILE, 8192  # a tile (8000 bytes) takes a 4 KiB-aligned block
    with TensorStore({"host": 4 * block + 2 * 2 * block + 2 * block + 4096}) as store:
        store.put("unit0", torch.randn(numel), "host")
        specs = [UnitSpec(numel, torch.float32, "unit0")]
        opt = SwappedOptimizer(specs, store, tile_numel=TILE, state_tier=Tier.HOST, **HYPER)
        keys, before = _keys(store), _state(opt)
        grad = _grads(specs, 0)[0]
        assert not opt.step_unit(0, grad, speculative=True)
        assert _kept(store, keys) == 0 and _keys(store) == keys
        assert _equal_states(_state(opt), before)
        assert opt.step_unit(0, grad)  # stepped plainly, once the step is decided
        opt.finish_step()


def test_a_unit_without_room_on_nvme_reads_nothing(tmp_path, put_units):
    """The swap file has no extent free for the new copies a speculative step writes while the
    old ones are kept: keep_unit (what the engine asks before reading a unit's gradient) and
    step_unit say so without reading a byte of the unit (at 7 B, 220 of 291 units read their
    state and values for nothing), the unit as it was; with room again it steps."""
    store, specs, opt = _nvme_run(tmp_path, put_units)
    with store:
        keys, before = _keys(store), _state(opt)
        for key in keys:
            store.evict(key, Tier.HOST)
        free = store._tiers.swap.free_nbytes()
        store.put("filler", torch.empty(free // 4), Tier.NVME)
        reads = _reads(store)
        grad = _grads(specs, 0)[0]
        assert not opt.keep_unit(0)
        assert not opt.step_unit(0, grad, speculative=True)
        assert _reads(store) == reads and _kept(store, keys | {"filler"}) == 0
        store.drop("filler")
        assert _equal_states(_state(opt), before)
        assert opt.keep_unit(0)
        assert opt.step_unit(0, grad, speculative=True)
        opt.commit_unit(0)
        for u, g in list(enumerate(_grads(specs, 0)))[1:]:
            assert opt.step_unit(u, g)
        opt.finish_step()


def test_keep_unit_without_room_for_a_copy_aside_keeps_nothing(tmp_path):
    """Two units step halves of one values entry, so a speculation copies its half aside
    (`KeptValues`): with the host tier full that copy finds no room, keep_unit says so and
    nothing is kept, not even the tiles; with room again the unit steps."""
    numel = 2 * TILE
    with TensorStore({"host": 4 * MiB}) as store:
        store.put("shared", torch.randn(numel), "host")
        specs = [UnitSpec(TILE, torch.float32, "shared", 0),
                 UnitSpec(TILE, torch.float32, "shared", TILE)]
        opt = SwappedOptimizer(specs, store, tile_numel=TILE, state_tier=Tier.HOST, **HYPER)
        keys, before = _keys(store), _state(opt)
        host = store.stats()["tiers"]["host"]
        store.put("filler", torch.empty((host.budget_nbytes - host.used_nbytes) // 4),
                  "host")
        assert not opt.keep_unit(0)
        assert _kept(store, keys | {"filler"}) == 0 and _equal_states(_state(opt), before)
        store.drop("filler")
        assert opt.keep_unit(0) and _kept(store, keys) == 2  # the tile, the half aside
        grads = _grads(specs, 0)
        assert opt.step_unit(0, grads[0], speculative=True)
        opt.commit_unit(0)
        assert _kept(store, keys) == 0
        assert opt.step_unit(1, grads[1])
        opt.finish_step()


def _reads(store):
    return store.stats()["moves"].get("nvme->host", {"moves": 0})["moves"]


def test_a_unit_spec_offset_is_rolled_back_in_its_slice_only(tmp_path, values_of):
    """A rank owning a slice of a unit (ZeRO stages 1-2): the rollback restores that slice."""
    with TensorStore({"host": 4 * MiB, "nvme": 8 * MiB}, nvme_path=tmp_path,
                     aio_options={"block_size": 64 << 10}) as store:
        whole = torch.randn(3000)
        store.put("unit", whole, "nvme")
        opt = SwappedOptimizer([UnitSpec(1000, torch.float32, "unit", 1500)], store,
                               tile_numel=TILE, **HYPER)
        assert opt.step_unit(0, torch.ones(1000), speculative=True)
        assert not torch.equal(values_of(store, "unit"), whole)
        opt.rollback_unit(0)
        assert torch.equal(values_of(store, "unit"), whole)


def _writes(store):
    moves = store.stats()["moves"].get("host->nvme", {"moves": 0, "nbytes": 0})
    return moves["moves"], moves["nbytes"]


def _nvme_run(path, put_units, handle=None):
    store = TensorStore({"host": 4 * MiB, "nvme": 8 * MiB}, nvme_path=path, aio_handle=handle,
                        aio_options=None if handle else {"block_size": 64 << 10})
    _, specs = put_units(store, [torch.float32] * len(NUMELS), NUMELS)
    opt = SwappedOptimizer(specs, store, tile_numel=TILE, **HYPER)
    store.flush()
    return store, specs, opt


def test_on_nvme_a_speculative_step_writes_what_a_plain_step_writes(tmp_path, put_units):
    """The store keeps the old tiles and values copy-on-write: not a byte written more than by
    the plain step (issue 22's cost), and the same state once committed."""
    writes, states = {}, {}
    for speculative in (False, True):
        (tmp_path / str(speculative)).mkdir()
        store, specs, opt = _nvme_run(tmp_path / str(speculative), put_units)
        with store:
            before = _writes(store)
            for u, grad in enumerate(_grads(specs, 0)):
                assert opt.step_unit(u, grad, speculative=speculative)
            store.flush()
            writes[speculative] = [a - b for a, b in zip(_writes(store), before)]
            for u in range(len(specs)) if speculative else ():
                opt.commit_unit(u)
            opt.finish_step()
            states[speculative] = _state(opt)
    assert writes[True] == writes[False] and writes[True][0] == 5 + len(NUMELS)  # tiles, values
    assert _equal_states(states[True], states[False])


@pytest.mark.parametrize("decision", ["rollback", "commit"])
def test_a_write_back_failing_in_a_speculative_step_loses_nothing(tmp_path, put_units,
                                                                 decision):
    """Each write of a speculative step fails in turn: the error surfaces (in a step or at the
    flush); a rollback gives back the state before the step bit for bit (the kept extents were
    never written); a commit, with a unit whose step failed rolled back and stepped plainly as
    the engine does and the optimizer flushed, gives the plain step's state."""
    (tmp_path / "plain").mkdir()
    store, specs, opt = _nvme_run(tmp_path / "plain", put_units)
    with store:
        before = _state(opt)
        for u, grad in enumerate(_grads(specs, 0)):
            opt.step_unit(u, grad)
        opt.finish_step()
        plain = _state(opt)
    for nth in range(5 + len(NUMELS)):  # every tile's and values' write-back
        (tmp_path / str(nth)).mkdir()
        handle = aio.Handle(block_size=64 << 10)
        store, specs, opt = _nvme_run(tmp_path / str(nth), put_units, handle)
        with store:
            handle.inject(aio.Fault(op="write", nth=nth, kind="errno", errno=errno.EIO))
            failed = _step_failing(store, specs, opt)
            assert failed, f"write {nth} failed and nothing said so"
            if decision == "rollback":
                for u in range(len(specs)):
                    opt.rollback_unit(u)
                assert _equal_states(_state(opt), before), nth
                assert not any(store.unsaved(key) for key in _keys(store)), nth
            else:
                for u in range(len(specs)):
                    if u in failed:
                        opt.rollback_unit(u)
                        opt.step_unit(u, _grads(specs, 0)[u])
                    else:
                        opt.commit_unit(u)
                opt.flush()  # rewrites what failed
                opt.finish_step()
                assert _equal_states(_state(opt), plain), nth
        handle.close()


def _step_failing(store, specs, opt):
    """Step every unit speculatively, then flush; returns the units whose step raised an
    AIOError (None: the flush raised it)."""
    failed = []
    for u, grad in enumerate(_grads(specs, 0)):
        try:
            assert opt.step_unit(u, grad, speculative=True)
        except aio.AIOError:
            failed.append(u)
    try:
        store.flush()
    except aio.AIOError:
        failed.append(None)
    return failed
