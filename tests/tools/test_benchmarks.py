"""Smoke tests of the benchmarks in tools/ on tiny sizes, so none of them can rot unnoticed.

Each runs main() in-process and checks the exit code and the line that carries its figure: the
ratio to the limit measured in the same run. The figures themselves mean nothing at these sizes.
"""

import json
import re

import pytest

from tools import bench_adam, bench_arena, bench_step, bench_store

PERCENT = r"\d+%"
NUMBER = r"\d+(\.\d+)?"


def run(capsys, main, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_adam_prints_each_row_against_the_memory_bound(capsys):
    code, out, _ = run(capsys, bench_adam.main, "--params", 20_000, "--steps", 2, "--warmup", 1,
                       "--copy-mib", 1, "--threads", 1, "--isa", "scalar")
    assert code == 0, out
    assert re.search(rf"memory bound = {NUMBER} GB/s", out), out
    ours = rf"\| infinity CPU Adam, fp32 grads, bf16 out \| {NUMBER} \| {NUMBER} \| {PERCENT} \|"
    assert re.search(ours, out), out
    assert re.search(rf"\| torch AdamW fused=True \(no copy-out\) \| {NUMBER} \| {NUMBER} "
                     rf"\| {PERCENT} \|", out)
    assert "| DeepSpeedCPUAdam |" in out  # timed, or "not installed"
    for fmt in ("moments bf16, master fp32", "moments int8, master fp32",
                "moments fp32, master none", "moments bf16, master none",
                "moments int8, master none"):  # each against the fp32 kernel, same run
        row = rf"\| infinity StateKernel, {fmt} \| {NUMBER} \| {NUMBER} \| {PERCENT} \| {NUMBER} \|"
        assert re.search(row, out), out


def test_bench_adam_formats_can_be_chosen_or_refused(capsys):
    code, out, _ = run(capsys, bench_adam.main, "--params", 4096, "--steps", 1, "--warmup", 0,
                       "--copy-mib", 1, "--threads", 1, "--formats", "int8/none")
    assert code == 0 and out.count("infinity StateKernel") == 1, out
    with pytest.raises(SystemExit):
        bench_adam.main(["--formats", "int4/none"])
    assert "--formats item 'int4/none'" in capsys.readouterr().err


def test_bench_arena_prints_compaction_against_memcpy(capsys):
    code, out, _ = run(capsys, bench_arena.main, "--arena-mib", 2, "--block-kib", 64,
                       "--repeats", 2, "--threads", 1)
    assert code == 0, out
    for pattern in ("half", "sliver"):
        assert re.search(rf"\| {pattern} \| \d+ \|( {NUMBER} \|){{3}} {PERCENT} \|", out), out


def test_bench_arena_fails_below_min_ratio(capsys):
    code, out, _ = run(capsys, bench_arena.main, "--arena-mib", 1, "--block-kib", 64,
                       "--repeats", 1, "--patterns", "half", "--min-ratio", 1000)
    assert code == 1 and "| half |" in out


def test_bench_store_stream_prints_the_ratio_and_cleans_up(tmp_path, capsys):
    disk = tmp_path / "disk"
    disk.mkdir()
    out_json = tmp_path / "store.json"
    code, out, _ = run(capsys, bench_store.main, "--path", disk, "--tensors", 9,
                       "--tensor-size", "256K", "--window", 2, "--repeat", 2,
                       "--block-size", "64K", "--queue-depth", 4, "--json", out_json)
    assert code == 0, out
    for label in ("read stream", "read+write stream"):
        assert re.search(rf"{re.escape(label)}: raw_gbps={NUMBER} +store_gbps={NUMBER} +"
                         rf"ratio={NUMBER} +ratio_range={NUMBER}-{NUMBER}", out), out
    results = json.loads(out_json.read_text())
    assert results["read stream"]["ratio"] > 0
    assert list(disk.iterdir()) == []


def test_bench_store_optimizer_prints_the_ratio_to_the_io_floor(tmp_path, capsys):
    code, out, _ = run(capsys, bench_store.main, "--path", tmp_path, "--mode", "optimizer",
                       "--params", "40K", "--tile", "8K", "--repeat", 1, "--block-size", "64K")
    assert code == 0, out
    assert re.search(rf"optimizer step \(checksum off\): params=40960 +tile=8192 "
                     rf".*ratio={NUMBER}", out), out
    assert list(tmp_path.iterdir()) == []


def test_bench_store_refuses_a_window_the_host_tier_would_cache(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        bench_store.main(["--path", str(tmp_path), "--tensors", "8", "--window", "2"])
    assert info.value.code == 2
    assert "--tensors must be more than" in capsys.readouterr().err


def test_bench_store_names_a_missing_path(tmp_path, capsys):
    code, _, err = run(capsys, bench_store.main, "--path", tmp_path / "missing")
    assert code == 2 and "cannot use --path" in err and "missing" in err


def test_bench_step_sets_the_engines_optimizer_state(capsys):
    from infinity.config import load_config

    args = bench_step.parse_args(["--path", "/tmp", "--bf16", "--optimizer-state", "int8",
                                  "--no-master"])
    config = load_config(bench_step.engine_config(args, "nvme", "/tmp"))
    assert config.bf16.enabled
    assert (config.infinity.optimizer_state.moments, config.infinity.optimizer_state.master) \
        == ("int8", "none")
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--path", "/tmp", "--no-master"])
    assert "--no-master needs --bf16" in capsys.readouterr().err
