"""bench_compute: the compute floor extrapolated from one- and two-layer passes of a model's config."""

import json

import pytest

from tools import bench_compute

pytest.importorskip("transformers")


def test_floor_extrapolates_from_one_and_two_layers(tmp_path, capsys, tiny_hf_model):
    assert bench_compute.main(["--model", str(tiny_hf_model), "--seq-len", "16", "--dtype", "fp32",
                               "--repeat", "2", "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    one, two = result["one_layer_s"], result["two_layers_s"]
    assert result["layers"] == 2 and 0 < one and 0 < two
    assert result["floor_s"] == pytest.approx(one + max(two - one, 0.0))
    assert result["flop"] == 6 * result["parameters"] * 16
    assert "compute floor" in capsys.readouterr().out
