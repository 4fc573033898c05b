"""Choosing the compute and storage dtypes."""

import pytest
import torch

from infinity import ConfigError
from infinity.engine._precision import Precision, choose_precision, cpu_has_bf16_units


def choose(**kw):
    args = {"fp16": False, "bf16": False, "compute_dtype": "auto", "accelerator": False,
            "bf16_units": False}
    return choose_precision(**{**args, **kw})


def test_bf16_computes_in_fp32_on_a_cpu_without_bf16_units(caplog):
    with caplog.at_level("INFO"):
        assert choose(bf16=True) == Precision(torch.float32, torch.bfloat16)
    assert "no bf16 units" in caplog.text
    assert choose(bf16=True, bf16_units=True) == Precision(torch.bfloat16, None)
    assert choose(bf16=True, accelerator=True) == Precision(torch.bfloat16, None)
    assert choose(bf16=True, bf16_units=True, compute_dtype="fp32") == Precision(torch.float32,
                                                                                 torch.bfloat16)
    assert choose(bf16=True, compute_dtype="bf16") == Precision(torch.bfloat16, None)


def test_fp32_and_fp16():
    assert choose() == Precision(torch.float32, None)
    assert choose(fp16=True) == Precision(torch.float16, None)


@pytest.mark.parametrize("kw", [{"compute_dtype": "bf16"}, {"fp16": True, "compute_dtype": "fp32"},
                                {"bf16": True, "compute_dtype": "fp16"}])
def test_impossible_compute_dtypes_name_the_key(kw):
    with pytest.raises(ConfigError, match="infinity.compute_dtype"):
        choose(**kw)


def test_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu sse avx2 avx512f\n")
    assert not cpu_has_bf16_units(str(info))
    info.write_text("processor : 0\nflags : fpu avx512f amx_bf16\n")
    assert cpu_has_bf16_units(str(info))
    assert not cpu_has_bf16_units(str(tmp_path / "missing"))
