"""State formats: bytes per element, the tile layout, and the 8-bit codes' rules in torch."""

import math

import pytest
import torch

from infinity.optim import StateFormat
from infinity.optim._quant import (
    EXP_AVG_CODE,
    EXP_AVG_SQ_CODE,
    block_scales,
    dequantize,
    encode,
    quantize,
)


@pytest.mark.parametrize(("moments", "master", "dtype", "expected"), [
    ("fp32", "fp32", torch.bfloat16, 12.0), ("fp32", "fp32", torch.float32, 8.0),
    ("bf16", "fp32", torch.bfloat16, 8.0), ("int8", "fp32", torch.float16, 6.03125),
    ("bf16", "none", torch.bfloat16, 4.0), ("int8", "none", torch.bfloat16, 2.03125),
    ("int8", "none", torch.float32, 2.03125),  # fp32 parameters are their own master
])
def test_bytes_per_element(moments, master, dtype, expected):
    assert StateFormat(moments, master).bytes_per_element(dtype) == expected


@pytest.mark.parametrize("fmt", [StateFormat(), StateFormat("bf16", "none"),
                                 StateFormat("int8", "fp32", block=128)], ids=str)
@pytest.mark.parametrize("numel", [0, 1, 77, 4096, 100_003])
def test_layout_rows_are_aligned_disjoint_and_cover_the_tile(fmt, numel):
    layout = fmt.layout(numel, torch.bfloat16)
    end = 0
    for row in layout.rows:
        assert row.offset % 64 == 0 and row.offset >= end
        end = row.offset + row.count * row.dtype.itemsize
    assert end <= layout.nbytes < end + 64
    names = [row.name for row in layout.rows]
    expected = ["master"] if fmt.master == "fp32" else []
    expected += ["exp_avg", "exp_avg_sq"]
    expected += ["exp_avg_scale", "exp_avg_sq_scale"] if fmt.quantized else []
    assert names == expected
    tile = torch.zeros(layout.nbytes, dtype=torch.uint8)
    views = layout.views(tile)
    for row in layout.rows:
        assert views[row.name].dtype == row.dtype and views[row.name].numel() == row.count
        views[row.name].view(torch.uint8).fill_(0xFF)
    assert int(tile.count_nonzero()) == sum(r.count * r.dtype.itemsize for r in layout.rows)


def test_float32_parameters_keep_no_master_row():
    assert [r.name for r in StateFormat("int8").layout(10, torch.float32).rows][0] == "exp_avg"
    with pytest.raises(TypeError, match="parameters must be float32, bfloat16 or float16"):
        StateFormat().layout(10, torch.float64)


@pytest.mark.parametrize("code", [EXP_AVG_CODE, EXP_AVG_SQ_CODE], ids=["exp_avg", "exp_avg_sq"])
def test_every_code_decodes_and_encodes_back_to_itself(code):
    table = code.table()
    assert torch.equal(encode(table, code), torch.arange(256).to(torch.uint8))
    mags = code.magnitudes()
    assert (mags[1:] > mags[:-1]).all() and mags[0] == 0
    assert mags[-1] == 2 - 2.0**-code.man_bits  # the top binade is [1, 2)


@pytest.mark.parametrize("code", [EXP_AVG_CODE, EXP_AVG_SQ_CODE], ids=["exp_avg", "exp_avg_sq"])
def test_encode_picks_the_nearest_code_ties_to_even(code):
    gen = torch.Generator().manual_seed(0)
    y = (torch.rand(200_000, generator=gen) * 2) * torch.exp2(
        -torch.randint(0, 24, (200_000,), generator=gen).float())
    if code.signed:
        y = y * torch.where(torch.rand(y.numel(), generator=gen) < 0.5, -1.0, 1.0)
    table = code.table().double()
    got = table[encode(y, code).long()]
    best = (table[None, :] - y.double()[:, None]).abs().min(dim=1).values
    err = (got - y.double()).abs()
    rescued = code.keep_nonzero & (got == table[1]) & (y > 0) & (y.double() <= table[1] / 2)
    assert ((err == best) | rescued).all()
    # midpoints go to the even code
    mags = code.magnitudes()
    mid = ((mags[1:-1] + mags[2:]) / 2).float()
    codes = encode(mid, code).long()
    assert (codes % 2 == 0).all()


def test_smallest_code_keeps_a_positive_second_moment_off_zero():
    x = torch.tensor([1.0, 1e-30, 0.0, 1e-45])
    codes, scales = quantize(x, 4, EXP_AVG_SQ_CODE)
    one = EXP_AVG_SQ_CODE.bias << EXP_AVG_SQ_CODE.man_bits  # 1.0: the top binade's first code
    assert codes.tolist() == [one, 1, 0, 1] and scales.tolist() == [1.0]
    codes, _ = quantize(x, 4, EXP_AVG_CODE)
    assert codes.tolist()[1:] == [0, 0, 0]


def test_block_scales_are_the_largest_magnitude_zero_or_nan():
    x = torch.tensor([3.0, -5.0, 0.0, 0.0, 1e-40, 3e-45, float("inf"), 1.0, 3e38, 7.0])
    scales = block_scales(x, 2)
    assert scales[:3].tolist() == [5.0, 0.0, torch.tensor(1e-40).item()]
    assert math.isnan(scales[3].item()) and scales[4].item() == torch.tensor(3e38).item()
    codes, scales = quantize(x, 2, EXP_AVG_CODE)
    back = dequantize(codes, scales, 2, EXP_AVG_CODE)
    assert back[[1, 4, 8]].tolist() == x[[1, 4, 8]].tolist()  # each block's largest is exact
    assert back[2:4].tolist() == [0.0, 0.0] and back[6:8].isnan().all()


def test_a_block_decaying_by_beta2_keeps_decaying():
    """v * 0.999 per step: a change far below the codes' 3-6% steps is kept by the scale, so the
    block decays as in float32 instead of freezing at its codes."""
    v = torch.rand(256, generator=torch.Generator().manual_seed(3)) + 0.5
    codes, scales = quantize(v, 256, EXP_AVG_SQ_CODE)
    start = dequantize(codes, scales, 256, EXP_AVG_SQ_CODE)
    for _ in range(100):
        decayed = dequantize(codes, scales, 256, EXP_AVG_SQ_CODE) * 0.999
        codes, scales = quantize(decayed, 256, EXP_AVG_SQ_CODE)
    ratio = dequantize(codes, scales, 256, EXP_AVG_SQ_CODE) / start
    torch.testing.assert_close(ratio, torch.full_like(ratio, 0.999**100), rtol=1e-5, atol=0)


def test_quantization_error_is_within_the_codes_spacing():
    """An element in the range of its block's normal codes (down to 2**-6 of the scale for m,
    2**-14 for v) comes back to within half a step: 1/32 of its magnitude (4 mantissa bits)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(100_000, generator=gen) * torch.exp2(
        torch.randint(-1, 1, (100_000,), generator=gen).float())
    for code, values in ((EXP_AVG_CODE, x), (EXP_AVG_SQ_CODE, x * x)):
        codes, scales = quantize(values, 256, code)
        back = dequantize(codes, scales, 256, code)
        per = scales.repeat_interleave(256)[:values.numel()]
        normal = values.abs() >= per * 2.0 ** (1 - code.bias)
        assert normal.float().mean() > 0.75  # most elements: the check is not vacuous
        half_step = values.abs()[normal] * 2.0 ** -(code.man_bits + 1)
        assert ((back - values).abs()[normal] <= half_step).all()


def test_dequantize_checks_its_inputs():
    with pytest.raises(TypeError, match="codes must be uint8"):
        dequantize(torch.zeros(4), torch.zeros(1), 4, EXP_AVG_CODE)
    with pytest.raises(ValueError, match="4 codes in blocks of 2 need 2 scales, got 1"):
        dequantize(torch.zeros(4, dtype=torch.uint8), torch.zeros(1), 2, EXP_AVG_CODE)
