"""tools.bench_grad_norm: a tiny GPT's pieces, a row per path, the native ones exact."""

import re

import pytest

from infinity.optim import available_isas
from tools import bench_grad_norm


def test_piece_sizes_are_the_gpt_parameters():
    # bench_step's GPT-2 at its defaults counts 294,027,264 parameters in 268 tensors
    # (transformers' GPT2LMHeadModel, the head tied to the embedding)
    sizes = bench_grad_norm.gpt_piece_sizes(22, 1024, 16384, 128)
    assert len(sizes) == 268 and sum(sizes) == 294_027_264


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_tiny_run_prints_every_row_and_the_native_sums_are_exact(capsys, dtype):
    assert bench_grad_norm.main(["--layers", "1", "--d-model", "64", "--vocab", "128",
                                 "--seq", "8", "--dtype", dtype, "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    for isa in available_isas():
        line = next(x for x in out.splitlines() if f"sum_squares, {isa}:" in x)
        assert float(re.search(r"rel error (\S+)", line).group(1)) < 1e-12
    assert "torch float32 vector_norm" in out and "memcpy" in out


@pytest.mark.parametrize("option", ["--rounds", "--layers", "--d-model"])
def test_counts_below_one_are_refused_naming_them(capsys, option):
    with pytest.raises(SystemExit) as exit_info:
        bench_grad_norm.main([option, "0"])
    assert exit_info.value.code == 2
    assert "--rounds must be at least 1" in capsys.readouterr().err
