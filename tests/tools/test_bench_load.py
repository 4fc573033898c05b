"""tools.bench_load: a tiny run prints the checkpoint, the peak RSS before and after loading and
the speed."""


from tools import bench_load


def test_tiny_run_prints_peaks_and_speed(tmp_path, capsys):
    argv = ["--path", str(tmp_path), "--layers", "1", "--hidden", "64", "--intermediate", "128",
            "--vocab", "256",
            "--window", "1M", "--host-budget", "64M", "--sub-group-size", "4096"]
    assert bench_load.main(argv) == 0
    out = capsys.readouterr().out
    assert "checkpoint 0 MiB bf16, window 1 MiB" in out
    assert "MiB building on meta" in out and "MB/s of checkpoint" in out
    assert list(tmp_path.iterdir()) == []  # the scratch directory is removed
