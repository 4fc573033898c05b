"""tools/bench_store.py runs end to end on tiny sizes, so it cannot rot."""

import json

import pytest

from tools import bench_store


def test_optimizer_mode_with_checksums_in_turns(tmp_path):
    out = tmp_path / "out.json"
    assert bench_store.main(["--path", str(tmp_path), "--mode", "optimizer", "--params", "64K",
                             "--tile", "16K",
                             "--checksum", "ab", "--repeat", "2", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["optimizer step (checksum on)"]["step_s"] > 0
    assert results["optimizer step (checksum off)"]["step_s"] > 0
    for checksum in ("on", "off"):
        step = results[f"optimizer step (checksum {checksum})"]
        assert step["round_ratio"] > 0 and 0 <= step["nvme_bytes_per_param"] <= 24
    assert results["checksum cost"]["median_ratio"] > 0


def test_stream_mode(tmp_path):
    out = tmp_path / "out.json"
    assert bench_store.main(["--path", str(tmp_path), "--tensors", "9", "--tensor-size", "256K",
                             "--window", "1",
                             "--repeat", "2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["read stream"]["store_gbps"] > 0


def test_checksum_ab_is_for_optimizer_mode(tmp_path):
    with pytest.raises(SystemExit):
        bench_store.main(["--path", str(tmp_path), "--checksum", "ab"])
