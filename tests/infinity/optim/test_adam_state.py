"""The compressed-state Adam kernel equals its torch reference (state_reference.py) bit for bit.

Every case runs each ISA the kernel has (one this CPU cannot run is skipped by name) over
several steps that carry the state, so a decoded code, a block scale, a rounding bit or a
vector tail that differs anywhere shows up as a bit difference in the state or the values.
"""

import pytest
import torch
from state_reference import reference_step

from infinity.memory import ThreadPool
from infinity.optim import SegmentState, StateFormat, StateKernel
from infinity.optim._quant import EXP_AVG_CODE, EXP_AVG_SQ_CODE, Code8

HYPER = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.05}
# (moments, master, values dtype); fp32 moments with a master are AdamKernel's (test_adam_kernel)
CASES = [
    ("bf16", "fp32", None), ("bf16", "fp32", torch.bfloat16), ("int8", "fp32", None),
    ("int8", "fp32", torch.float16), ("int8", "fp32", torch.bfloat16),
    ("fp32", "none", torch.bfloat16), ("fp32", "none", torch.float16),
    ("bf16", "none", torch.bfloat16), ("bf16", "none", torch.float16),
    ("int8", "none", torch.bfloat16), ("int8", "none", torch.float16),
]
CASE_IDS = [f"{m}-{ma}-{str(v).removeprefix('torch.')}" for m, ma, v in CASES]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    diff = (bits(got) != bits(want)).nonzero()
    if diff.numel():
        i = diff[0].item()
        pytest.fail(f"{what}: {diff.numel()} of {got.numel()} elements differ, first at {i}: "
                    f"{got[i].item()!r} vs reference {want[i].item()!r}")


class Segment:
    """One segment's state in a zeroed tile (Adam's initial state) and its parameters, plus a
    copy that the reference steps alongside."""

    def __init__(self, fmt: StateFormat, n: int, values_dtype: torch.dtype | None, seed: int,
                 offset: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.fmt, self.n = fmt, n
        start = -(-offset // fmt.block) * fmt.block if fmt.quantized else offset
        layout = fmt.layout(start + n, torch.float32 if values_dtype is None else values_dtype)
        self.views = layout.views(torch.zeros(layout.nbytes, dtype=torch.uint8))
        params = torch.randn(n, generator=gen)
        self.values = None if values_dtype is None else params.to(values_dtype)
        self.outer_master = None  # float32 parameters: their own master
        if values_dtype is None:
            self.outer_master = params.clone()
        elif "master" in self.views:
            self.views["master"][start:].copy_(self.values.float())
        self.state = layout.segment(self.views, start, start + n, master=self.outer_master)
        self.ref = {k: v.clone() for k, v in self._named().items() if k != "values"}
        self.ref_values = None if self.values is None else self.values.clone()

    def _named(self) -> dict[str, torch.Tensor]:
        named = {k: v for k, v in self.state._asdict().items() if v is not None}
        if self.values is not None:
            named["values"] = self.values
        return named

    def step(self, grad: list[torch.Tensor], *, step: int, isa: str, index: int = 0,
             seed: int = 0, threads: int = 1, pool: ThreadPool | None = None,
             **hyper: object) -> None:
        """The kernel on the segment, the reference on its copy, with the same arguments."""
        hyper = {"adamw": True, **HYPER, **hyper}
        StateKernel(self.fmt, step=step, isa=isa, threads=threads, pool=pool, seed=seed,
                    **hyper)(self.state, grad if len(grad) > 1 else grad[0], self.values,
                             index=index)
        out = reference_step(self.fmt, self.ref, grad, self.ref_values, step=step, index=index,
                             seed=seed, **hyper)
        self.ref_values = out.pop("values", None)
        self.ref = out

    def check(self, what: str) -> None:
        for name, got in self._named().items():
            want = self.ref_values if name == "values" else self.ref[name]
            assert_bits_equal(got, want, f"{what} {name}")


def kernel_of(fmt: StateFormat, step: int, isa: str, seed: int = 0) -> StateKernel:
    return StateKernel(fmt, step=step, isa=isa, threads=1, seed=seed, adamw=True, **HYPER)


def random_grad(n: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize(("moments", "master", "values_dtype"), CASES, ids=CASE_IDS)
def test_kernel_equals_reference_over_steps(moments, master, values_dtype, adamw, isa):
    """Odd sizes around vector widths and block edges, three steps carrying the state."""
    fmt = StateFormat(moments, master, block=128)
    for n in (1, 7, 15, 17, 63, 64, 65, 127, 128, 129, 255, 257, 1000):
        seg = Segment(fmt, n, values_dtype, seed=n)
        for step in (1, 2, 3):
            grad = random_grad(n, torch.bfloat16 if step % 2 else torch.float32, seed=10 * n + step)
            seg.step([grad], step=step, isa=isa, index=5 * n, seed=3, adamw=adamw)
            seg.check(f"n={n} step={step} {isa}")


MASTER_FREE = [(m, ma, v) for m, ma, v in CASES if ma == "none"]


@pytest.mark.parametrize(("moments", "master", "values_dtype"), MASTER_FREE,
                         ids=[f"{m}-{str(v).removeprefix('torch.')}" for m, _, v in MASTER_FREE])
def test_rounding_counters_across_2_32_equal_reference(moments, master, values_dtype, isa):
    """Master-free blocks whose rounding counters cross a multiple of 2**32 (which the SIMD
    loops split there: each side has its own key) round as the reference, with the crossing at
    every offset within a vector."""
    fmt = StateFormat(moments, master, block=64)
    n = 64 * 9 + 5
    for shift in range(17):
        seg = Segment(fmt, n, values_dtype, seed=shift)
        grad = random_grad(n, torch.bfloat16 if shift % 2 else torch.float32, seed=shift)
        seg.step([grad], step=1, isa=isa, index=3 * 2**32 - 64 * 4 - shift, seed=4)
        seg.check(f"shift={shift} {isa}")


@pytest.mark.parametrize("block", [64, 256, 4096])
@pytest.mark.parametrize("master", ["fp32", "none"])
def test_threads_and_block_sizes_equal_reference(block, master, isa):
    """A segment long enough for several threads and chunks, with the block sizes' extremes."""
    fmt = StateFormat("int8", master, block=block)
    n = 3 * 65536 + 1001
    with ThreadPool(2) as pool:
        seg = Segment(fmt, n, torch.bfloat16, seed=1)
        for step in (1, 2):
            grad = random_grad(n, torch.bfloat16, seed=step)
            seg.step([grad], step=step, isa=isa, threads=2, pool=pool, index=123, seed=9)
            seg.check(f"block={block} step={step} {isa}")


def _edge_values(n: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Parameters and gradients with blocks of zeros, huge, tiny and subnormal magnitudes, and
    blocks mixing magnitudes 2**40 apart (subnormal codes, smallest-code rule)."""
    params = torch.randn(n, generator=gen)
    grad = torch.randn(n, generator=gen)
    grad[0:128] = 0.0                                   # all-zero block
    grad[128:256] *= 1e18                               # huge: v = g^2 ~ 1e36, still finite
    grad[256:384] *= 1e-30                              # tiny
    grad[384:512] = torch.randn(128, generator=gen) * 1e-41  # subnormal gradients
    grad[512:640:2] *= 2.0**-40                         # magnitudes 2^40 apart in one block
    params[640:768] *= 1e30
    params[768:896] = 1e-40                             # subnormal parameters
    params[896:1024] = 0.0
    grad[1024:] *= torch.exp2(torch.randint(-60, 60, (n - 1024,), generator=gen).float())
    return {"params": params, "grad": grad}


@pytest.mark.parametrize(("moments", "master", "values_dtype"), CASES, ids=CASE_IDS)
def test_edge_values_equal_reference(moments, master, values_dtype, isa):
    fmt = StateFormat(moments, master, block=128)
    n = 2048 + 77
    gen = torch.Generator().manual_seed(4)
    edges = _edge_values(n, gen)
    seg = Segment(fmt, n, values_dtype, seed=0)
    with torch.no_grad():
        p = edges["params"]
        if seg.values is not None:
            seg.values.copy_(p.to(seg.values.dtype))
            seg.ref_values.copy_(seg.values)
        master_row = seg.state.master
        if master_row is not None:
            master_row.copy_(p if seg.values is None else seg.values.float())
            seg.ref["master"].copy_(master_row)
    for step in (1, 2, 3, 4):
        grad = edges["grad"] * (1.0 if step % 2 else -0.5)
        seg.step([grad], step=step, isa=isa, index=2**32 - 1000, seed=step)
        seg.check(f"step={step} {isa}")


def _ulps_around(x: torch.Tensor, ulps: int) -> torch.Tensor:
    """float32 x and its neighbours up to `ulps` float32 steps either side."""
    out, up, down = [x], x, x
    for _ in range(ulps):
        up, down = torch.nextafter(up, up + 1), torch.nextafter(down, down - 1)
        out += [up, down]
    return torch.cat(out)


def _near_midpoints(code: Code8) -> torch.Tensor:
    """float32 values y around every midpoint of two neighbouring magnitude codes: a few
    float32 ulps off, and a few half steps of the float32 subnormal grid that
    |y| * 2**(bias - 127) rounds to first below the normal codes (where a coding that skips
    that rounding, or takes it with the wrong step, picks the other neighbour)."""
    mags = code.magnitudes()
    mids = (mags[1:] + mags[:-1]) / 2
    half_step = 2.0 ** (-150 + 127 - code.bias)
    near = torch.cat([mids + k * half_step for k in range(-3, 4)]).float()
    return _ulps_around(near, 2).clamp(max=1.0).unique()


def test_codes_near_every_midpoint_equal_reference(isa):
    """Moments at and around the 8-bit codes' midpoints take the reference's code ([Note: no
    float subnormals]: every path finds |y| * 2**(bias - 127)'s bits without forming that
    float subnormal). beta1 = beta2 = 0 makes m = g and v = g * g, and a 1.0 at the head of
    each block makes both scales 1, so y is m and v themselves."""
    m = _near_midpoints(EXP_AVG_CODE)
    v = _ulps_around(_near_midpoints(EXP_AVG_SQ_CODE).sqrt(), 1)
    values = torch.cat([m, -m, v])
    block = 64
    rows = -(-values.numel() // (block - 1))
    body = torch.zeros(rows * (block - 1))
    body[:values.numel()] = values
    grad = torch.cat([torch.ones(rows, 1), body.view(rows, block - 1)], dim=1).view(-1)
    seg = Segment(StateFormat("int8", "fp32", block=block), grad.numel(), torch.bfloat16, seed=5)
    seg.step([grad], step=1, isa=isa, beta1=0.0, beta2=0.0, weight_decay=0.0)
    seg.check(isa)


def _nans(*patterns: int) -> torch.Tensor:
    return torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)


@pytest.mark.parametrize(("moments", "master", "values_dtype"), CASES, ids=CASE_IDS)
def test_nan_payloads_round_as_the_scalar_path(moments, master, values_dtype, isa):
    """A NaN gradient or master whose payload has low bits set (which a rounding without the
    NaN case would carry into the bf16 bits) leaves the same bits on every path as on the
    scalar one: the SIMD loops take the NaN case of all of a vector's bf16 roundings (moments,
    the master's copy, stochastic rounding) when any lane of its new parameter is NaN. The
    torch reference does not model NaN payloads; the scalar path is the reference here."""
    fmt = StateFormat(moments, master, block=64)
    n = 256 + 13
    segs = {name: Segment(fmt, n, values_dtype, seed=7) for name in ("scalar", isa)}
    grad = random_grad(n, torch.float32, seed=8)
    grad[[3, 70, 201, 260]] = _nans(0x7F80FFFF, 0xFFC0ABCD, 0x7FC08001, 0xFF80C000)
    for seg in segs.values():
        if seg.state.master is not None:
            seg.state.master[[9, 130, 264]] = _nans(0x7FC0FFFF, 0xFF808001, 0x7F81FFFF)
        kernel_of(fmt, 1, "scalar" if seg is segs["scalar"] else isa)(
            seg.state, grad, seg.values)
    for name, got in segs[isa]._named().items():
        assert_bits_equal(got, segs["scalar"]._named()[name], f"{isa} {name}")


@pytest.mark.parametrize("big", [1e30, 1e38])
@pytest.mark.parametrize(("moments", "master", "values_dtype"),
                         [("int8", "none", torch.bfloat16), ("bf16", "fp32", torch.float16)],
                         ids=["int8-none", "bf16-fp32"])
def test_overflowed_moments_make_their_block_nan(moments, master, values_dtype, big, isa):
    """A gradient whose square overflows makes v inf: an 8-bit block holding it is stored as
    NaN (scale NaN), a bf16 one as inf, exactly as the reference does; other blocks are fine.
    1e38 also takes m's scale past FLT_MAX / 2**8, which the SIMD loops cannot fold into their
    decode (q8_f16_scale): they leave that block to the scalar loop."""
    fmt = StateFormat(moments, master, block=64)
    seg = Segment(fmt, 256, values_dtype, seed=2)
    grad = random_grad(256, torch.float32, seed=3)
    grad[70] = big
    for step in (1, 2):
        seg.step([grad], step=step, isa=isa)
        for name, got in seg._named().items():
            want = seg.ref_values if name == "values" else seg.ref[name]
            assert torch.equal(got.float().isnan(), want.float().isnan()), f"{name} NaNs"
            finite = ~want.float().isnan()
            assert_bits_equal(got[finite], want[finite], f"step={step} {name}")
    if moments == "int8":
        assert seg.state.exp_avg_sq_scale[1].isnan() and seg.state.exp_avg_sq_scale[0] > 0


def test_gradient_pieces_equal_one_gradient(isa):
    """A unit's gradient as several tensors (empty ones, mixed dtypes, boundaries inside
    blocks) steps exactly as the same values in one tensor."""
    fmt = StateFormat("int8", "none", block=64)
    n = 1000
    whole = random_grad(n, torch.float32, seed=5).to(torch.bfloat16)
    cuts = [0, 0, 3, 64, 64, 100, 511, 999, 1000, 1000]
    pieces = [whole[a:b].clone() for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    pieces[3] = pieces[3].float()  # exact: bf16 widened
    one, split = Segment(fmt, n, torch.bfloat16, seed=6), Segment(fmt, n, torch.bfloat16, seed=6)
    for step in (1, 2):
        kernel_of(fmt, step, isa)(one.state, whole, one.values)
        kernel_of(fmt, step, isa)(split.state, pieces, split.values)
        for name, got in split._named().items():
            assert_bits_equal(got, one._named()[name], f"step={step} {name}")


@pytest.mark.parametrize("moments", ["int8", "bf16"])
def test_split_at_a_block_equals_whole(moments, isa):
    """Two segments cut at a block boundary, each with its own index, step exactly as the
    whole: results depend on the element, never on how the tile was cut."""
    fmt = StateFormat(moments, "none", block=256)
    n, cut = 3000, 1024
    grad = random_grad(n, torch.bfloat16, seed=7)
    whole, parts = Segment(fmt, n, torch.bfloat16, seed=8), Segment(fmt, n, torch.bfloat16, seed=8)
    layout = fmt.layout(n, torch.bfloat16)
    for step in (1, 2, 3):
        kernel_of(fmt, step, isa, seed=1)(whole.state, grad, whole.values, index=40)
        for lo, hi in ((0, cut), (cut, n)):
            state = layout.segment(parts.views, lo, hi)
            kernel_of(fmt, step, isa, seed=1)(state, grad[lo:hi], parts.values[lo:hi],
                                              index=40 + lo)
        for name, got in parts._named().items():
            assert_bits_equal(got, whole._named()[name], f"step={step} {name}")


def test_resumed_run_is_bit_identical(isa):
    """Steps 1-6 in one go equal steps 1-3, the state copied out and back (a checkpoint), and
    steps 4-6 with new kernels: the rounding depends on (seed, step, index) only."""
    fmt = StateFormat("int8", "none")
    n = 5000
    grads = [random_grad(n, torch.bfloat16, seed=s) for s in range(1, 7)]
    straight, resumed = Segment(fmt, n, torch.bfloat16, seed=9), Segment(fmt, n, torch.bfloat16,
                                                                          seed=9)
    for step, grad in enumerate(grads, start=1):
        kernel_of(fmt, step, isa, seed=77)(straight.state, grad, straight.values, index=11)
    for step, grad in enumerate(grads[:3], start=1):
        kernel_of(fmt, step, isa, seed=77)(resumed.state, grad, resumed.values, index=11)
    saved = {k: v.clone() for k, v in resumed._named().items()}
    for t in resumed._named().values():
        t.fill_(0)
    for name, t in resumed._named().items():
        t.copy_(saved[name])
    for step, grad in enumerate(grads[3:], start=4):
        kernel_of(fmt, step, isa, seed=77)(resumed.state, grad, resumed.values, index=11)
    for name, got in resumed._named().items():
        assert_bits_equal(got, straight._named()[name], name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_stochastic_rounding_is_unbiased_and_seeded(dtype, isa):
    """Without a master, an update far below the 16-bit spacing still moves the parameters on
    average: the mean of the rounded values equals the float32 result to within the sampling
    error; the same seed gives the same bits and another seed other bits."""
    n = 1 << 16
    fmt = StateFormat("fp32", "none")
    results = {}
    for seed in (1, 1, 2):
        values = torch.full((n,), 1.0, dtype=dtype)
        state = SegmentState(None, torch.zeros(n), torch.zeros(n))
        # lr 1e-4 with sign(g) = -1: the first Adam step adds about 1e-4, a few % of a spacing
        StateKernel(fmt, step=1, lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0,
                    adamw=True, seed=seed, isa=isa, threads=1)(state, -torch.ones(n), values)
        results.setdefault(seed, []).append(values)
    first, again = results[1]
    assert torch.equal(bits(first), bits(again))
    assert not torch.equal(bits(first), bits(results[2][0]))
    spacing = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    up = (first.float() > 1.0).double().mean().item()
    assert set(first.float().unique().tolist()) == {1.0, 1.0 + spacing}
    # P(up) = 1e-4 / spacing; binomial sd sqrt(p / n) is under 1e-3 here: 5 sd of room
    assert abs(up - 1e-4 / spacing) < 5 * (1e-4 / spacing / n) ** 0.5, up


def test_each_elements_rounding_is_fresh_every_step(isa):
    """Each element's random bits are uniform and new every step, not only spread over the
    elements of one step: over 400 steps each element of 1000 rounds up as often as the steps'
    probabilities say (a stream that repeated an element's bits from step to step would round
    it up always or never)."""
    n, steps, lr, spacing = 1000, 400, 2e-3, 2.0**-7
    ups = torch.zeros(n, dtype=torch.float64)
    expected = 0.0
    variance = 0.0
    for step in range(1, steps + 1):
        values = torch.full((n,), 1.0, dtype=torch.bfloat16)
        state = SegmentState(None, torch.zeros(n), torch.zeros(n))
        StateKernel(StateFormat("fp32", "none"), step=step, lr=lr, beta1=0.9, beta2=0.999,
                    eps=1e-8, weight_decay=0.0, adamw=True, seed=5, isa=isa, threads=1)(
            state, -torch.ones(n), values)
        ups += (values.float() > 1.0).double()
        # Adam's update with a gradient of -1 from zero moments: lr * m_hat / sqrt(v_hat)
        m_hat = 0.1 / (1 - 0.9**step)
        v_hat = 0.001 / (1 - 0.999**step)
        chance = lr * m_hat / (v_hat**0.5 + 1e-8) / spacing
        expected += chance
        variance += chance * (1 - chance)
    worst = (ups - expected).abs().max().item()
    assert worst < 6 * variance**0.5, (worst, expected, variance**0.5)


def test_fp16_stochastic_rounding_of_subnormals(isa):
    """fp16 values below 2**-14 are spaced 2**-24: rounding picks one of the two neighbours
    with the right probability there too (through the shift into the binade above)."""
    n = 1 << 16
    tiny = 2.0**-24
    values = torch.full((n,), 3 * tiny, dtype=torch.float16)
    state = SegmentState(None, torch.zeros(n), torch.zeros(n))
    # a zero gradient leaves only AdamW's decay: p = 3 * tiny * (1 - 1/6), about 2.5 * tiny
    StateKernel(StateFormat("fp32", "none"), step=1, lr=1.0, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=1.0 / 6.0, adamw=True, isa=isa, threads=1)(
        state, torch.zeros(n), values)
    got = values.float()
    assert set(got.unique().tolist()) == {2 * tiny, 3 * tiny}
    up = (got == 3 * tiny).double().mean().item()
    assert abs(up - 0.5) < 5 * (0.25 / n) ** 0.5, up
