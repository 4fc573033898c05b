"""SwappedOptimizer (step_unit / finish_step) equals in-memory CPUAdam
bit for bit, in any unit order, from several threads, and after a failed step_unit is retried."""

import threading

import pytest
import torch

from infinity.optim import CPUAdam, DecaySpan, SwappedOptimizer, UnitSpec
from infinity.optim._decay import UnitKernels
from infinity.store import TensorStore, Tier

MiB = 1 << 20
TILE = 1000
NUMELS = [2500, 7, 1000, 1234, 3000]  # bigger than a tile, tiny, exactly one tile, ...
HYPER = dict(betas=(0.8, 0.99), eps=1e-7, weight_decay=0.1)


def _store(path, host=1 * MiB, **kw):
    path.mkdir(exist_ok=True)
    return TensorStore({"host": host, "nvme": 8 * MiB}, nvme_path=path,
                       aio_options={"block_size": 64 << 10}, **kw)


def _grads(specs, step):
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s.numel, generator=g).to(s.dtype) for s in specs]


def _ref_step(opt_ref, masters, grads, lr, grad_scale=1.0):
    for m, g in zip(masters, grads):
        m.grad = g.float() * grad_scale
    opt_ref.param_groups[0]["lr"] = lr
    opt_ref.step()


def _run_steps(opt, grads_per_step, lrs, order, grad_scales):
    for grads, lr, scale in zip(grads_per_step, lrs, grad_scales):
        opt.lr = lr
        assert opt.begin_step() == opt.completed_steps + 1 == opt.begin_step()
        for u in order:
            opt.step_unit(u, grads[u], grad_scale=scale)
        opt.finish_step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_units_equal_cpu_adam_bit_for_bit(tmp_path, dtype, order, put_units, values_of):
    """lr changed between steps and a grad_scale of 0.5 in one of them, as a scheduler and a
    clip factor would; bf16 units: the values entry is the master rounded to bf16."""
    dtypes = [dtype] * len(NUMELS)
    steps, lrs, scales = 4, [1e-2, 5e-3, 2e-3, 1e-3], [1.0, 0.5, 1.0, 1.0]
    with _store(tmp_path) as store:
        masters, specs = put_units(store, dtypes, NUMELS)
        opt_ref = CPUAdam(masters, lr=lrs[0], **HYPER)
        opt = SwappedOptimizer(specs, store, lr=lrs[0], tile_numel=TILE, **HYPER)
        assert len(opt.tiles) == sum(-(-n // TILE) for n in NUMELS)  # cut per unit
        all_grads = [_grads(specs, s) for s in range(steps)]
        units = list(range(len(specs)))
        _run_steps(opt, all_grads, lrs, units[::-1] if order == "reverse" else units, scales)
        for grads, lr, scale in zip(all_grads, lrs, scales):
            _ref_step(opt_ref, masters, grads, lr, scale)
        assert opt.completed_steps == steps
        for (u, state), master, spec in zip(opt.iter_state(), masters, specs):
            assert state["step"] == steps
            assert torch.equal(state["master"], master), u
            assert torch.equal(state["exp_avg"], opt_ref.state[master]["exp_avg"]), u
            assert torch.equal(state["exp_avg_sq"], opt_ref.state[master]["exp_avg_sq"]), u
            assert torch.equal(values_of(store, spec.values_key), master.to(dtype)), u


def test_fp32_units_track_torch_adamw(tmp_path, put_units, values_of):
    with _store(tmp_path) as store:
        masters, specs = put_units(store, [torch.float32] * len(NUMELS), NUMELS, seed=1)
        torch_params = [m.clone().requires_grad_() for m in masters]
        torch_opt = torch.optim.AdamW(torch_params, lr=1e-2, **HYPER)
        opt = SwappedOptimizer(specs, store, lr=1e-2, tile_numel=TILE, **HYPER)
        for step in range(3):
            grads = _grads(specs, step)
            for p, g in zip(torch_params, grads):
                p.grad = g.clone()
            torch_opt.step()
            _run_steps(opt, [grads], [1e-2], range(len(specs)), [1.0])
        for p, spec in zip(torch_params, specs):
            torch.testing.assert_close(values_of(store, spec.values_key), p.detach(),
                                       rtol=1e-6, atol=1e-7)


def test_weight_decay_ranges_cut_a_unit_where_the_decay_changes():
    spans = [DecaySpan(2, 5, 0.1), DecaySpan(5, 6, 0.0), DecaySpan(9, 12, 0.2)]
    kernels = UnitKernels(lambda wd: f"wd={wd}", 0.5, spans)  # a kernel per decay
    assert list(kernels.ranges(0, 14)) == [(0, 2, "wd=0.5"), (2, 5, "wd=0.1"), (5, 6, "wd=0.0"),
                                           (6, 9, "wd=0.5"), (9, 12, "wd=0.2"),
                                           (12, 14, "wd=0.5")]
    assert list(kernels.ranges(3, 10)) == [(3, 5, "wd=0.1"), (5, 6, "wd=0.0"), (6, 9, "wd=0.5"),
                                           (9, 10, "wd=0.2")]
    assert list(UnitKernels(str, 0.5).ranges(3, 10)) == [(3, 10, "0.5")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_decay_spans_equal_cpu_adam_groups(tmp_path, put_units, dtype):
    """A unit's elements in spans of their own decay (across tiles and the gradient's pieces)
    step as CPUAdam's parameter groups of those decays, bit for bit."""
    spans = [DecaySpan(1200, 1250, 0.0), DecaySpan(300, 1200, 0.3), DecaySpan(2400, 2500, 0.05)]
    cuts, decays = [0, 300, 1200, 1250, 2400, 2500], [0.1, 0.3, 0.0, 0.1, 0.05]
    with _store(tmp_path) as store:
        (master,), specs = put_units(store, [dtype], [2500])
        parts = [master[a:b].clone() for a, b in zip(cuts, cuts[1:])]
        opt_ref = CPUAdam([{"params": [p], "weight_decay": wd} for p, wd in zip(parts, decays)],
                          lr=1e-2, betas=HYPER["betas"], eps=HYPER["eps"])
        opt = SwappedOptimizer(specs, store, lr=1e-2, tile_numel=TILE, **HYPER)
        opt.set_weight_decay(0, spans)
        for step in range(2):
            (grad,) = _grads(specs, step)
            for p, a, b in zip(parts, cuts, cuts[1:]):
                p.grad = grad[a:b].float()
            opt_ref.step()
            opt.step_unit(0, [grad[:700], grad[700:]])  # pieces cut inside a span
            opt.finish_step()
        (_, state), = opt.iter_state()
        assert torch.equal(state["master"], torch.cat(parts))
        with pytest.raises(ValueError, match="disjoint ranges within"):
            opt.set_weight_decay(0, [DecaySpan(0, 10, 0.1), DecaySpan(5, 20, 0.1)])
        with pytest.raises(ValueError, match=r"disjoint ranges within \[0, 2500\)"):
            opt.set_weight_decay(0, [DecaySpan(2000, 2501, 0.1)])
        with pytest.raises(ValueError, match="Invalid weight_decay"):
            opt.set_weight_decay(0, [DecaySpan(0, 10, -0.1)])


def test_fp32_units_keep_no_master_in_the_tiles(tmp_path, put_units):
    with _store(tmp_path) as store:
        _, specs = put_units(store, [torch.float32, torch.bfloat16], [1500, 1500])
        opt = SwappedOptimizer(specs, store, tile_numel=TILE)
        shapes = [tuple(store.fetch(opt.tiles.key(t), "host").result().shape)
                  for t in range(len(opt.tiles))]
        for t in range(len(opt.tiles)):
            store.release(opt.tiles.key(t), "host")
        assert shapes == [(2, 1000), (2, 500), (3, 1000), (3, 500)]  # 8 B/element vs 12 B/element


def test_units_stepped_from_several_threads(tmp_path, put_units, values_of):
    dtypes = [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16, torch.float16] * 2
    numels = NUMELS * 2
    with _store(tmp_path / "a") as store, _store(tmp_path / "b") as serial_store:
        _, specs = put_units(store, dtypes, numels)
        store.put("other", torch.ones(3000), "nvme")
        _, serial_specs = put_units(serial_store, dtypes, numels)
        opt = SwappedOptimizer(specs, store, lr=1e-2, tile_numel=TILE, threads=1)
        serial = SwappedOptimizer(serial_specs, serial_store, lr=1e-2, tile_numel=TILE)
        for step in range(3):
            grads = _grads(specs, step)
            errors = []

            def work(units, grads=grads, errors=errors):
                try:
                    for u in units:
                        opt.step_unit(u, grads[u])
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)

            workers = [threading.Thread(target=work, args=(range(k, len(specs), 4),))
                       for k in range(4)]
            for w in workers:
                w.start()
            while any(w.is_alive() for w in workers):  # the caller uses the store meanwhile
                store.fetch("other", "host").result()
                store.release("other", "host", dirty=True)
            for w in workers:
                w.join(timeout=60)
            assert not any(w.is_alive() for w in workers) and errors == []
            opt.finish_step()
            _run_steps(serial, [grads], [1e-2], range(len(specs)), [1.0])
        for (u, state), (_, expected) in zip(opt.iter_state(), serial.iter_state()):
            for name in ("master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(state[name], expected[name]), (u, name)
            assert torch.equal(values_of(store, specs[u].values_key),
                               values_of(serial_store, serial_specs[u].values_key))


def test_finish_step_names_the_units_not_stepped(tmp_path, put_units):
    with _store(tmp_path) as store:
        _, specs = put_units(store, [torch.float32] * 3, [10, 2000, 10])
        opt = SwappedOptimizer(specs, store, tile_numel=TILE)
        grads = _grads(specs, 0)
        opt.step_unit(0, grads[0])
        with pytest.raises(ValueError, match=r"units \[1, 2\] were not stepped for step 1"):
            opt.finish_step()
        assert opt.completed_steps == 0 and opt.begin_step() == 1
        opt.step_unit(2, grads[2])
        opt.step_unit(2, grads[2])  # a repeat is a retry: no tile is updated twice
        with pytest.raises(ValueError, match=r"units \[1\]"):
            opt.finish_step()
        opt.step_unit(1, grads[1])
        opt.finish_step()
        assert opt.completed_steps == 1 and opt.begin_step() == 2


def test_state_on_the_host_tier_needs_no_nvme(tmp_path, values_of):
    with TensorStore({"host": 1 * MiB}) as store:
        specs = []
        values = [torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in NUMELS]
        for u, v in enumerate(values):
            store.put(f"unit{u}", v, "host")
            specs.append(UnitSpec(v.numel(), torch.float32, f"unit{u}"))
        masters = [v.clone() for v in values]
        opt_ref = CPUAdam(masters, lr=1e-2)
        opt = SwappedOptimizer(specs, store, lr=1e-2, tile_numel=TILE, state_tier=Tier.HOST)
        for step in range(2):
            grads = _grads(specs, step)
            _ref_step(opt_ref, masters, grads, 1e-2)
            _run_steps(opt, [grads], [1e-2], range(len(specs)), [1.0])
        for spec, master in zip(specs, masters):
            assert torch.equal(values_of(store, spec.values_key), master)
        assert store.tiers_of(opt.tiles.key(0)) == ["host"]
        with pytest.raises(ValueError, match="NVMe budget"):
            SwappedOptimizer(specs, store, name="other")  # state_tier NVME by default


class _RowSource:
    """A row given to load_state by range, as a checkpoint reader gives it; records each read."""

    def __init__(self, row):
        self._row, self.reads = row.reshape(-1), []

    def numel(self):
        return self._row.numel()

    def read_into(self, start, stop, out):
        self.reads.append(stop - start)
        out.copy_(self._row[start:stop])


@pytest.mark.parametrize("rows", ["tensors", "sources"])
def test_unit_state_streams_out_and_back_in(tmp_path, put_units, values_of, rows):
    dtypes = [torch.bfloat16, torch.float32, torch.float32, torch.bfloat16, torch.float32]
    with _store(tmp_path / "a") as store, _store(tmp_path / "b") as other:
        _, specs = put_units(store, dtypes, NUMELS)
        opt = SwappedOptimizer(specs, store, lr=1e-2, tile_numel=TILE)
        for step in range(2):
            _run_steps(opt, [_grads(specs, step)], [1e-2], range(len(specs)), [1.0])
        give = _RowSource if rows == "sources" else torch.clone
        saved = [(u, {k: (give(v) if torch.is_tensor(v) else v) for k, v in s.items()})
                 for u, s in opt.iter_state()]
        # other values: the state brings its own
        _, twin_specs = put_units(other, dtypes, NUMELS, seed=5)
        twin = SwappedOptimizer(twin_specs, other, lr=1e-2, tile_numel=2 * TILE + 7)
        twin.load_state(saved)
        assert twin.completed_steps == 2
        # read a tile's segment at a time (a float32 unit's master: whole, into its values)
        if rows == "sources":
            reads = [n for _, s in saved for name, v in s.items()
                     if name in ("exp_avg", "exp_avg_sq") for n in v.reads]
            assert reads and max(reads) <= 2 * TILE + 7
        for step in range(2, 4):
            grads = _grads(specs, step)
            _run_steps(opt, [grads], [1e-2], range(len(specs)), [1.0])
            _run_steps(twin, [grads], [1e-2], range(len(specs)), [1.0])
        for spec, twin_spec in zip(specs, twin_specs):
            assert torch.equal(values_of(store, spec.values_key),
                               values_of(other, twin_spec.values_key))
        assert [(u, s["step"]) for u, s in opt.iter_state()] == [(u, 4) for u in range(len(specs))]


def test_bad_input(tmp_path, put_units, values_of, in_use):
    with _store(tmp_path) as store:
        _, specs = put_units(store, [torch.float32, torch.bfloat16], [100, 50])
        with pytest.raises(ValueError, match="no units"):
            SwappedOptimizer([], store)
        with pytest.raises(ValueError, match="unit 1: numel"):
            SwappedOptimizer([specs[0], UnitSpec(0, torch.float32, "unit1")], store)
        with pytest.raises(ValueError, match="unit 0: dtype torch.int32"):
            SwappedOptimizer([UnitSpec(100, torch.int32, "unit0")], store)
        with pytest.raises(ValueError, match="'nope' is not in the store"):
            SwappedOptimizer([UnitSpec(100, torch.float32, "nope")], store)
        with pytest.raises(ValueError, match="'unit0' holds 100 x torch.float32; "
                                             "expected 100 x torch.bfloat16"):
            SwappedOptimizer([specs[1], UnitSpec(100, torch.bfloat16, "unit0")], store, name="w")
        # its tiles were dropped
        assert [k for k in store._copies.entries if k.startswith("w/")] == []
        wrong = SwappedOptimizer([UnitSpec(50, torch.float32, "unit1")], store, name="w")
        with pytest.raises(ValueError,
                           match="'unit1' holds 50 x torch.bfloat16; expected 50 x torch.float32"):
            wrong.step_unit(0, torch.ones(50))
        assert in_use(store) == []
        opt = SwappedOptimizer(specs, store, tile_numel=TILE)
        grad = torch.ones(100)
        for scale in (0, -1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="grad_scale must be a finite number > 0"):
                opt.step_unit(0, grad, grad_scale=scale)
        for bad, match in ((torch.ones(99), "unit 0's gradient must be contiguous with 100"),
                           (torch.ones(100, dtype=torch.int64), "unit 0's gradient has dtype"),
                           (torch.ones(10, 10), "unit 0's gradient must be 1-D"),
                           (torch.ones(200)[::2], "contiguous")):
            with pytest.raises((ValueError, TypeError), match=match):
                opt.step_unit(0, bad)
        for value in (float("nan"), float("inf"), -float("inf")):
            bad = grad.clone()
            bad[3] = value
            with pytest.raises(ValueError, match="unit 0's gradient has non-finite values"):
                opt.step_unit(0, bad)
        with pytest.raises(ValueError, match=r"unit must be an int in \[0, 2\)"):
            opt.step_unit(2, grad)
        assert opt.tiles.steps == [0] * len(opt.tiles)  # nothing was updated
        bad = grad.clone()
        bad[0] = float("nan")
        opt.step_unit(0, bad, check_finite=False)  # the caller checked (or chose not to)
        assert values_of(store, "unit0").isnan().any()


def test_large_finite_fp16_gradients_are_not_an_overflow(tmp_path, put_units):
    """Summed in float16 these would overflow to inf; the finite check sums in float32."""
    with _store(tmp_path) as store:
        _, specs = put_units(store, [torch.float16], [100])
        opt = SwappedOptimizer(specs, store, lr=1e-3)
        opt.step_unit(0, torch.full((100,), 60000.0, dtype=torch.float16), grad_scale=1 / 65536)
        opt.finish_step()
        assert opt.completed_steps == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slices_stepped_by_two_owners_equal_the_whole_unit(tmp_path, dtype, put_units, values_of):
    """UnitSpec.offset: two optimizers (two data-parallel ranks' shards) each step their slice of
    the same values entries; together they equal one optimizer over the whole units, bit for
    bit, and neither touches the other's slice."""
    numels = [2501, 7, 1000]
    with _store(tmp_path, host=2 * MiB) as store:
        masters, specs = put_units(store, [dtype] * len(numels), numels)
        opt_ref = CPUAdam(masters, lr=1e-2, **HYPER)
        owners = []
        for r in range(2):
            size = [-(-n // 2) for n in numels]
            slices = [UnitSpec(min(s, n - r * s), dtype, spec.values_key, r * s)
                      for n, s, spec in zip(numels, size, specs)]
            owners.append((slices, SwappedOptimizer(slices, store, lr=1e-2, tile_numel=TILE,
                                                               name=f"rank{r}", **HYPER)))
        for step in range(3):
            grads = _grads(specs, step)
            _ref_step(opt_ref, masters, grads, 1e-2)
            for slices, opt in owners:
                for u, spec in enumerate(slices):
                    opt.step_unit(u, grads[u][spec.offset:spec.offset + spec.numel].contiguous())
                opt.finish_step()
        for spec, master in zip(specs, masters):
            assert torch.equal(values_of(store, spec.values_key), master.to(dtype))
        (_, first), _ = owners
        state = dict(first.iter_state())[0]
        assert torch.equal(state["exp_avg"], opt_ref.state[masters[0]]["exp_avg"][:1251])


def test_bad_offsets(tmp_path, put_units):
    with _store(tmp_path) as store:
        _, specs = put_units(store, [torch.float32], [100])
        for offset in (-1, 1.5, True):
            with pytest.raises(ValueError, match="unit 0: offset must be an int >= 0"):
                SwappedOptimizer([UnitSpec(10, torch.float32, "unit0", offset)], store)
        past_the_end = SwappedOptimizer([UnitSpec(10, torch.float32, "unit0", 95)], store)
        with pytest.raises(ValueError,
                           match=r"'unit0' holds 100 x torch.float32; expected \[95:105\] of"):
            past_the_end.step_unit(0, torch.ones(10))


def test_prefetch_unit_reads_ahead_and_holds_nothing(tmp_path, put_units, values_of, in_use):
    """prefetch_unit starts the next unit's first tile (and its values) toward the host while
    nothing is held; stepping afterwards is bit for bit what it is without; a unit already
    stepped for the step being built has nothing to read."""
    numels = [3000, 3000]
    with _store(tmp_path, host=256 << 10) as store:
        masters, specs = put_units(store, [torch.float32] * 2, numels)
        opt_ref = CPUAdam(masters, lr=1e-2, **HYPER)
        opt = SwappedOptimizer(specs, store, lr=1e-2, tile_numel=TILE, **HYPER)
        first_tile = [opt.tiles.key(opt.tiles.of_unit[u][0]) for u in range(2)]
        for step in range(2):
            grads = _grads(specs, step)
            store.flush()
            for key in first_tile[1:] + ["unit1"]:
                if "host" in store.tiers_of(key):
                    store.evict(key, "host")
                assert store.tiers_of(key) == ["nvme"]
            opt.step_unit(0, grads[0])
            assert opt.prefetch_unit(1) == ["unit1", first_tile[1]]
            assert in_use(store) == []
            store.flush()
            assert "host" in store.tiers_of(first_tile[1]) and "host" in store.tiers_of("unit1")
            opt.step_unit(1, grads[1])
            assert opt.prefetch_unit(1) == [] and opt.prefetch_unit(0) == []  # both at this step
            opt.finish_step()
            _ref_step(opt_ref, masters, grads, 1e-2)
        for u, master in enumerate(masters):
            assert torch.equal(values_of(store, f"unit{u}"), master)
        with pytest.raises(ValueError, match=r"unit must be an int in \[0, 2\)"):
            opt.prefetch_unit(2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gradient_in_pieces_steps_as_the_same_gradient_whole(tmp_path, dtype, put_units,
                                                               values_of):
    """The engine hands a unit's gradient as its parameters' own tensors laid end to end;
    pieces that cross tile boundaries (TILE 1000) and tiny ones give the whole-gradient result
    bit for bit, and the pieces are only read."""
    cuts = {2500: [1, 998, 2, 1499], 1234: [1234], 3000: [1000, 1000, 1000]}
    with _store(tmp_path / "whole") as whole_store, _store(tmp_path / "pieces") as pieces_store:
        specs_by_store = []
        for store in (whole_store, pieces_store):
            _, specs = put_units(store, [dtype] * 3, list(cuts), seed=3)
            specs_by_store.append(specs)
        whole = SwappedOptimizer(specs_by_store[0], whole_store, lr=1e-2, tile_numel=TILE, **HYPER)
        pieces = SwappedOptimizer(specs_by_store[1], pieces_store, lr=1e-2, tile_numel=TILE,
                                  **HYPER)
        for step in range(2):
            grads = _grads(specs_by_store[0], step)
            for u, (grad, sizes) in enumerate(zip(grads, cuts.values())):
                whole.step_unit(u, grad)
                split = [p.clone() for p in grad.split(sizes)]
                pieces.step_unit(u, split)
                assert torch.equal(torch.cat(split), grad)
            whole.finish_step()
            pieces.finish_step()
        for a, b in zip(specs_by_store[0], specs_by_store[1]):
            assert torch.equal(values_of(whole_store, a.values_key),
                               values_of(pieces_store, b.values_key))
        for (_, a), (_, b) in zip(whole.iter_state(), pieces.iter_state()):
            assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq"))


def test_bad_gradient_pieces(tmp_path, put_units):
    with _store(tmp_path) as store:
        _, specs = put_units(store, [torch.float32], [100])
        opt = SwappedOptimizer(specs, store, tile_numel=TILE)
        for bad, error, match in (
                ([torch.ones(60), torch.ones(39)], ValueError,
                 "lay 100 elements end to end, got 99"),
                ([], TypeError, "non-empty list"),
                ((torch.ones(100) for _ in ()), TypeError, "generator"),
                ([torch.ones(50), "x"], TypeError, r"piece 1\) must be a torch.Tensor"),
                ([torch.ones(50), torch.ones(5, 10)], ValueError, r"piece 1\) must be 1-D"),
                ([torch.ones(50), torch.ones(100)[::2]], ValueError, "contiguous")):
            with pytest.raises(error, match=match):
                opt.step_unit(0, bad)
        nan = torch.ones(50)
        nan[7] = float("nan")
        with pytest.raises(ValueError, match="unit 0's gradient has non-finite values"):
            opt.step_unit(0, [torch.ones(50), nan])
        assert opt.tiles.steps == [0]  # nothing was updated


def test_a_streamed_tile_is_needed_again_after_what_a_step_fetches(tmp_path, put_units):
    """After its update a tile's next-use hint is the store's fetches since its last update (a
    whole step's, however many values and gradients the step fetches beside the tiles), at
    least one per tile: values the next forward needs sooner are evicted after it."""
    with _store(tmp_path) as store:
        _, specs = put_units(store, [torch.float32] * len(NUMELS), NUMELS)
        opt = SwappedOptimizer(specs, store, lr=1e-2, tile_numel=TILE)
        hints, set_next_use = [], store.set_next_use
        store.set_next_use = lambda h: (hints.append((dict(h), store.clock)), set_next_use(h))
        clocks = []
        for step in range(3):
            if step == 2:  # 50 fetches of something else between the steps
                for _ in range(50):
                    with store.hold(specs[0].values_key):
                        pass
            clocks.append(store.clock)
            _run_steps(opt, [_grads(specs, step)], [1e-2], range(len(specs)), [1.0])
        key = opt.tiles.key(0)
        after = [d for h, _ in hints for k, d in h.items() if k == key and d >= len(opt.tiles)]
        assert after[0] == len(opt.tiles)  # first update: no last one to measure from
        assert after[1] == clocks[1] - clocks[0]  # a step's fetches (here above the tile count)
        assert after[1] > len(opt.tiles)
        assert after[2] == clocks[2] - clocks[1]
