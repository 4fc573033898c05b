"""SwappedOptimizer with a compressed StateFormat: tiles of the format's real bytes, the state
streamed out and back in to the same bytes (a resumed run repeats every step bit for bit, the
stochastic rounding included), the host budget counted in those bytes, bad arguments refused."""

import pytest
import torch
from conftest import read_back

from infinity.optim import DecaySpan, StateFormat, SwappedOptimizer
from infinity.optim._tiles import PackedTileFormat
from infinity.store import TensorStore

FORMATS = [StateFormat("bf16", "fp32"), StateFormat("int8", "fp32"), StateFormat("fp32", "none"),
           StateFormat("bf16", "none"), StateFormat("int8", "none")]
NUMELS = [1500, 700]  # tiles of 512: whole blocks of 256 and a short last one


def _optimizer(tmp_path, put_units, dtype, fmt, seed=0, name="a"):
    store = TensorStore({"host": 8 << 20, "nvme": 8 << 20}, nvme_path=tmp_path)
    _, specs = put_units(store, [dtype] * len(NUMELS), NUMELS)
    return SwappedOptimizer(specs, store, lr=1e-2, tile_numel=512, state_format=fmt, seed=seed,
                            name=name)


def _step(opt, grads):
    for u, g in enumerate(grads):
        opt.step_unit(u, g)
    opt.finish_step()


def _grads(step, dtype):
    g = torch.Generator().manual_seed(step)
    # magnitudes from 1e-12 to 1e6 within a tile: blocks whose scales span the float range
    return [(torch.randn(n, generator=g) * 10.0 ** torch.randint(-12, 7, (n,), generator=g))
            .to(dtype) for n in NUMELS]


def _tiles(opt):
    return [read_back(opt.store, opt.tiles.key(t)) for t in range(len(opt.tiles))]


def _values(opt):
    return [read_back(opt.store, u.values_key) for u in opt.units]


# float32 parameters are their own master: master "none" is moot for them
CASES = [(torch.bfloat16, f) for f in FORMATS] + [(torch.float32, f) for f in FORMATS[:2]]


@pytest.mark.parametrize(("dtype", "fmt"), CASES,
                         ids=lambda c: str(c).split(".")[-1] if isinstance(c, torch.dtype)
                         else f"{c.moments}-{c.master}")
def test_state_streams_out_and_in_to_the_same_bytes(tmp_path, put_units, dtype, fmt):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = _optimizer(tmp_path / "a", put_units, dtype, fmt)
    packed = fmt.moments != "fp32" or dtype != torch.float32
    assert isinstance(first.tiles.formats[0], PackedTileFormat) == packed
    for step in range(1, 4):
        _step(first, _grads(step, dtype))
    state = [(u, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()})
             for u, s in first.iter_state()]
    second = _optimizer(tmp_path / "b", put_units, dtype, fmt)  # same values, other state
    second.load_state(state)
    for name, a, b in zip(("tile",) * len(first.tiles), _tiles(first), _tiles(second)):
        assert torch.equal(a, b), name
    _step(first, _grads(4, dtype))
    _step(second, _grads(4, dtype))
    for a, b in zip(_values(first), _values(second)):
        assert torch.equal(a, b)


def test_tiles_hold_the_formats_bytes(tmp_path, put_units):
    opt = _optimizer(tmp_path, put_units, torch.bfloat16, StateFormat("int8", "none"))
    sizes = [read_back(opt.store, opt.tiles.key(t)).numel() for t in range(len(opt.tiles))]
    layouts = [StateFormat("int8", "none").layout(tile.numel, torch.bfloat16).nbytes
               for tile in opt.tiles.tiles]
    assert sizes == layouts and opt.state_nbytes == sum(layouts)
    # 2.03 bytes per element and rows padded to 64 bytes (12 per element by default)
    assert opt.state_nbytes < 2.5 * sum(NUMELS)


def test_no_master_rounds_by_the_seed(tmp_path, put_units):
    runs = {}
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        (tmp_path / name).mkdir()
        opt = _optimizer(tmp_path / name, put_units, torch.bfloat16, StateFormat("bf16", "none"),
                         seed=seed)
        for step in range(1, 3):
            _step(opt, _grads(step, torch.bfloat16))
        runs[name] = torch.cat(_values(opt))
    assert torch.equal(runs["a"], runs["b"])
    assert not torch.equal(runs["a"], runs["c"])


def test_the_host_budget_is_counted_in_the_formats_bytes(tmp_path, put_units):
    """Three tiles of 4096 bf16 elements: 147 KiB with fp32 state, 25 KiB with int8 moments
    and no master; a 64 KiB host tier streams only the latter."""
    store = TensorStore({"host": 64 << 10, "nvme": 4 << 20}, nvme_path=tmp_path)
    _, specs = put_units(store, [torch.bfloat16], [3 * 4096])
    with pytest.raises(ValueError, match="must hold at least 3 optimizer tiles of 49152 bytes"):
        SwappedOptimizer(specs, store, tile_numel=4096)
    opt = SwappedOptimizer(specs, store, tile_numel=4096, state_format=StateFormat("int8", "none"))
    opt.step_unit(0, torch.ones(3 * 4096, dtype=torch.bfloat16))
    opt.finish_step()


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"state_format": "int8"}, TypeError, "state_format must be a StateFormat"),
    ({"seed": -1}, ValueError, r"seed must be an int in \[0, 2\*\*64\)"),
    ({"seed": 1.5}, ValueError, "seed must be an int"),
])
def test_bad_format_arguments_are_refused(tmp_path, put_units, kwargs, error, match):
    store = TensorStore({"host": 1 << 20, "nvme": 1 << 20}, nvme_path=tmp_path)
    _, specs = put_units(store, [torch.bfloat16], [64])
    with pytest.raises(error, match=match):
        SwappedOptimizer(specs, store, **kwargs)


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_decay_ranges_step_as_their_own_decay_does(tmp_path, put_units, moments):
    """A client's parameter groups (DecaySpan) in a compressed format: the elements of a range
    end exactly as a run with that decay everywhere leaves them (the kernel is elementwise, an
    8-bit block's scale is its own elements': ranges on blocks change no neighbour)."""
    fmt = StateFormat(moments, "none")
    runs = {}
    for name, decay, spans in (("none", 0.0, ()), ("all", 0.1, ()),
                               ("mixed", 0.1, [DecaySpan(256, 768, 0.0)])):
        (tmp_path / name).mkdir()
        opt = _optimizer(tmp_path / name, put_units, torch.bfloat16, fmt, name=name)
        opt.weight_decay = decay
        for u, s in enumerate([spans, ()]):
            opt.set_weight_decay(u, s)
        for step in range(1, 3):
            _step(opt, _grads(step, torch.bfloat16))
        runs[name] = _values(opt)[0]
    assert torch.equal(runs["mixed"][256:768], runs["none"][256:768])
    assert torch.equal(runs["mixed"][:256], runs["all"][:256])
    assert torch.equal(runs["mixed"][768:], runs["all"][768:])
    assert not torch.equal(runs["none"], runs["all"])
    if moments == "int8":
        with pytest.raises(ValueError, match="inside an 8-bit block of 256 elements"):
            opt.set_weight_decay(0, [DecaySpan(100, 600, 0.0)])
