"""tools.bench_crc32c: a tiny run prints a row per implementation and memcpy."""

import aio
from tools import bench_crc32c


def test_tiny_run_prints_every_row(capsys):
    assert bench_crc32c.main(["--size", "64K", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "memcpy" in out and "crc32c portable" in out
    assert ("crc32c hardware" in out) == aio.crc32c_hardware_available()


def test_measure_reports_positive_rates():
    gbps = bench_crc32c.measure(4096, rounds=3, warmup=0)
    assert all(len(values) == 3 and min(values) > 0 for values in gbps.values())
