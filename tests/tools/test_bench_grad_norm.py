"""tools.bench_grad_norm: a tiny GPT's pieces, a row per path, the native ones exact."""

import re

import pytest

from infinity.optim import available_isas
from tools import bench_grad_norm


def test_piece_sizes_are_the_gpt_parameters():
    import transformers
    cfg = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=1, n_positions=8)
    model = transformers.GPT2LMHeadModel(cfg)
    sizes = bench_grad_norm.gpt_piece_sizes(2, 32, 96, 8)
    assert sorted(sizes) == sorted(p.numel() for p in model.parameters())


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_tiny_run_prints_every_row_and_the_native_sums_are_exact(capsys, dtype):
    assert bench_grad_norm.main(["--layers", "1", "--d-model", "64", "--vocab", "128",
                                 "--seq", "8", "--dtype", dtype, "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    for isa in available_isas():
        line = next(x for x in out.splitlines() if f"sum_squares, {isa}:" in x)
        assert float(re.search(r"rel error (\S+)", line).group(1)) < 1e-12
    assert "torch float32 vector_norm" in out and "memcpy" in out
