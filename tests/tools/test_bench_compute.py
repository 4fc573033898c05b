"""bench_compute: the compute floor extrapolated from the timed decoder layers of a two-layer
pass."""

import json

import pytest

from tools import bench_compute


def test_floor_is_the_rest_plus_every_layer_at_the_median(tmp_path, capsys, tiny_hf_model):
    assert bench_compute.main(["--model", str(tiny_hf_model), "--seq-len", "16", "--dtype", "fp32",
                               "--repeat", "2", "--json", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    low, high = result["layer_s_range"]
    assert result["layers"] == 2 and 0 < low <= result["layer_s"] <= high and result["rest_s"] > 0
    assert result["floor_s"] == pytest.approx(result["rest_s"] + 2 * result["layer_s"])
    assert result["flop"] == 6 * result["parameters"] * 16
    assert "compute floor" in capsys.readouterr().out
