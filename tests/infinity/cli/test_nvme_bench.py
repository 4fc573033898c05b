"""infinity-nvme-bench end to end on tiny sizes, plus the measuring helpers in
infinity.cli.nvme_measure."""

import argparse
import json
import os
import textwrap

import pytest
import torch

import aio
from infinity.cli import args as cli
from infinity.cli import nvme_bench
from infinity.cli import nvme_measure as bench


@pytest.fixture
def disk(tmp_path):
    """The --path directory; tests check it is left empty."""
    path = tmp_path / "disk"
    path.mkdir()
    return path


def o_direct_opens(directory) -> bool:
    """Whether this file system opens files with O_DIRECT (tmpfs before Linux 6.6 does not)."""
    probe = os.path.join(directory, ".o-direct-probe")
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600))
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


def run(capsys, *argv):
    code = nvme_bench.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("text, nbytes", [
    ("4096", 4096), ("256K", 256 << 10), ("1M", 1 << 20), ("2G", 2 << 30), ("2g", 2 << 30),
    ("1GiB", 1 << 30), ("1T", 1 << 40), ("1.5G", 3 << 29), ("8MB", 8_000_000), ("2GB", 2 * 10**9),
])
def test_sizes_mean_what_the_config_means(text, nbytes):
    """One parser: a size on a command line is what the same text means in a config."""
    from infinity.config import parse_bytes

    assert cli.parse_size(text) == nbytes == parse_bytes(text)
    assert cli.parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "G", "1.3B", "-1M", "0", "3X", "1MM"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="is not a size"):
        cli.parse_size(text)


def test_default_run_writes_then_reads_and_leaves_nothing(disk, tmp_path, capsys):
    out_json = tmp_path / "result.json"
    code, out, _ = run(capsys, "--path", disk, "--size", "8M", "--small-requests", 300,
                       "--json", out_json)
    assert code == 0
    assert "GB/s = 1e9 bytes/s" in out and "4 KiB random reads" in out
    assert list(disk.iterdir()) == []
    result = json.loads(out_json.read_text())
    direct = o_direct_opens(tmp_path)  # the same file system as disk (left empty)
    assert result["size_bytes"] == 8 << 20 and result["o_direct"] is direct
    assert f"O_DIRECT {'yes' if direct else 'NO'}" in out
    report = result["report"]
    assert list(report["sequential"]) == ["write", "read"]
    ours = f"aio/{report['config']['backend']}"
    for op in ("write", "read"):
        (first,) = report["sequential"][op][ours]
        assert first["nbytes"] == 8 << 20 and first["gbps"] > 0
        assert 0 < first["p50_s"] <= first["p99_s"]
    (small,) = report["small"][ours]
    assert (small["requests"] == 300 and small["request_nbytes"] == 4096
            and small["us_per_request"] > 0)


def test_read_only_repeats_and_reports_the_range(disk, capsys, tmp_path):
    out_json = tmp_path / "r.json"
    code, out, _ = run(capsys, "--path", disk, "--size", "4M", "--read", "--repeat", 2,
                       "--small-requests", 0, "--backend", "threads", "--json", out_json)
    assert code == 0 and "median [min-max] of 2" in out
    report = json.loads(out_json.read_text())["report"]
    assert (list(report["sequential"]) == ["read"]
            and len(report["sequential"]["read"]["aio/threads"]) == 2)
    assert "small" not in report


def test_sweep_prints_a_table_and_the_best_aio_block(disk, capsys, tmp_path):
    out_json = tmp_path / "sweep.json"
    code, out, _ = run(capsys, "--path", disk, "--size", "4M", "--sweep",
                       "--block-size", "64K,256K",
                       "--queue-depth", "2", "--threads", "1,2", "--backend", "threads",
                       "--small-requests", 0, "--json", out_json)
    assert code == 0
    result = json.loads(out_json.read_text())
    assert len(result["sweep"]) == 4
    assert {tuple(row["config"].values()) for row in result["sweep"]} == {
        (bs, 2, threads, "threads") for bs in (64 << 10, 256 << 10) for threads in (1, 2)}
    block = result["best"]["aio"]
    assert set(block) == {"block_size", "queue_depth", "intra_op_parallelism", "thread_count",
                          "backend", "single_submit", "overlap_events"}
    assert block["thread_count"] == block["intra_op_parallelism"]
    assert block["single_submit"] is False and block["overlap_events"] is True
    printed = out[out.index('{\n  "aio"'):]
    assert json.loads(printed[:printed.index("\n}") + 2]) == result["best"]
    assert list(disk.iterdir()) == []


def test_sweep_fills_in_the_grid_for_options_not_given():
    args = nvme_bench.build_parser().parse_args(["--path", ".", "--sweep", "--threads", "1"])
    configs = nvme_bench._grid(args)
    assert {c.threads for c in configs} == {1}
    assert {c.block_size for c in configs} == {256 << 10, 1 << 20, 4 << 20}
    assert {c.queue_depth for c in configs} == {4, 16, 64}
    assert len(configs) == 9 * len(aio.available_backends())


def test_mix_reports_read_write_and_combined(disk, capsys, tmp_path):
    out_json = tmp_path / "mix.json"
    code, out, _ = run(capsys, "--path", disk, "--size", "8M", "--mix", "--json", out_json)
    assert code == 0 and "combined" in out
    (mix,) = json.loads(out_json.read_text())["mix"]
    assert mix["layers"] >= bench.MIN_LAYERS
    assert mix["read_nbytes"] == 2 * mix["write_nbytes"]  # forward + backward reads, one write-back
    assert mix["combined_gbps"] == pytest.approx(mix["read_gbps"] + mix["write_gbps"])
    paused = mix["paused"]  # the disk's own pauses in the timed span, where it has counters
    assert paused is None or 0 <= paused["seconds"] <= paused["sampled_s"] <= mix["seconds"] + 1
    assert ("paused" in out) == (paused is not None)
    assert list(disk.iterdir()) == []


@pytest.mark.skipif(bench.find_fio() is None, reason="fio is not installed")
def test_fio_comparison_gives_ratios_and_the_overhead(disk, capsys, tmp_path):
    out_json = tmp_path / "fio.json"
    code, out, _ = run(capsys, "--path", disk, "--size", "4M", "--fio", "--small-requests", 200,
                       "--queue-depth", 4, "--json", out_json)
    assert code == 0 and "per-request overhead" in out
    report = json.loads(out_json.read_text())["report"]
    for op in ("write", "read"):
        assert set(report["ratio_ours_over_fio"][op]) == {"fio/io_uring", "fio/libaio"}
        assert report["sequential"][op]["fio/libaio"][0]["nbytes"] == 4 << 20
    assert report["small"]["fio/libaio"][0]["requests"] == 200
    assert report["overhead_us"]["reference"].startswith("fio/")
    assert list(disk.iterdir()) == []


def test_missing_path_is_refused_clearly(tmp_path, capsys):
    code, _, err = run(capsys, "--path", tmp_path / "absent", "--size", "4M")
    assert code == 2 and "no such directory" in err
    (tmp_path / "file").write_text("x")
    code, _, err = run(capsys, "--path", tmp_path / "file", "--size", "4M")
    assert code == 2 and "no such directory" in err
    code, _, err = run(capsys, "--size", "4M")
    assert code == 2 and "--path" in err


def test_unwritable_path_is_refused_clearly(read_only_dir, run_unprivileged):
    """Run as an unprivileged user (root may write anywhere), the tool refuses the directory
    before writing anything, with usage exit code 2."""
    out = run_unprivileged(textwrap.dedent(f"""
        from infinity.cli import nvme_bench
        try:
            code = nvme_bench.main(["--path", {read_only_dir!r}, "--size", "4M"])
        except SystemExit as exc:
            code = exc.code
        print("EXIT", code)
    """), preload=("infinity.cli.nvme_bench",))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "EXIT 2" in out.stdout and "not writable by this user" in out.stderr
    assert read_only_dir in out.stderr and os.listdir(read_only_dir) == []


def test_a_size_that_does_not_fit_is_refused_before_writing(disk, capsys):
    code, _, err = run(capsys, "--path", disk, "--size", "1000T")
    assert code == 2 and "does not fit" in err and "pass a smaller --size" in err
    assert list(disk.iterdir()) == []


def test_interrupt_removes_the_temporary_directory(disk, capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        assert len(list(disk.iterdir())) == 1  # the work directory exists meanwhile
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "sequential", interrupted)
    code, _, err = run(capsys, "--path", disk, "--size", "4M")
    assert code == 130 and "interrupted" in err
    assert list(disk.iterdir()) == []


def test_pick_best_prefers_less_memory_within_noise():
    small = bench.EngineConfig(block_size=1 << 20, queue_depth=8)
    large = bench.EngineConfig(block_size=4 << 20, queue_depth=64)
    assert bench.pick_best([(large, 2.00), (small, 1.92)]) == small
    assert bench.pick_best([(large, 2.00), (small, 1.50)]) == large


def test_mix_uses_real_layer_shapes_when_they_fit():
    specs, layers = bench.plan_layers(2 << 30)
    shapes = {spec.shape for spec in specs}
    assert {(4096, 4096), (11008, 4096), (4096, 11008), (4096,)} == shapes
    assert layers == 5
    assert {spec.dtype for spec in specs} == {torch.bfloat16, torch.float32}


def test_a_json_file_that_cannot_be_written_is_refused_before_the_benchmark(disk, tmp_path, capsys):
    for target in (tmp_path / "absent" / "x.json", tmp_path):
        code, out, err = run(capsys, "--path", disk, "--size", "4M", "--json", target)
        assert code == 2 and f"--json {target}:" in err and out == "", err
    assert list(disk.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["disk"]
