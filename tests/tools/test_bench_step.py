"""tools/bench_step.py runs end to end on a tiny GPT, so it cannot rot."""

import json

import pytest
from children import ROOT, child_env

from tools import bench_step


@pytest.fixture(autouse=True)
def children_import_this_checkout(monkeypatch):
    """main() starts `python -m tools.bench_step` children: from here, with this checkout."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])


TINY = ["--layers", "1", "--d-model", "32", "--vocab", "64", "--seq", "8",
        "--sub-group-size", "2048"]


@pytest.mark.parametrize("config", ["nvme", "torch", "torch-default"])
def test_a_child_reports_its_figures(tmp_path, config):
    args = bench_step.parse_args(["--path", str(tmp_path), *TINY, "--steps", "2", "--warmup", "1"])
    result = bench_step.run_child(args, config, str(tmp_path))
    assert (result["step_s"] > 0 and result["cpu_s"] > 0 and result["peak_rss"] > 0
            and result["params"] > 0 and result["cores"] >= 1)
    # the training thread's step: on a core, waiting for one, asleep; none of it negative
    assert 0 <= result["main_runq_s"] < result["step_s"]
    assert 0 <= result["main_sleep_s"] < result["step_s"]
    if config == "nvme":
        assert result["bytes_per_step"] > 0 and result["raw_gbps"] > 0
        assert result["on_demand_nvme_after_step_1"] == 0  # the trace prefetches every unit
        # a tiny model in a budget that holds it: the host tier never needs compacting
        assert result["compactions_per_step"] == 0 and result["compaction_s_per_step"] == 0


def test_a_kernel_without_schedstat_gives_null_thread_figures(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_step, "SCHEDSTAT", str(tmp_path / "no-schedstat"))
    args = bench_step.parse_args(["--path", str(tmp_path), *TINY, "--steps", "2", "--warmup", "1"])
    result = bench_step.run_child(args, "torch", str(tmp_path))
    assert result["step_s"] > 0 and result["cpu_s"] > 0
    assert result["main_runq_s"] is None and result["main_sleep_s"] is None


def test_main_runs_each_config_in_a_child(tmp_path):
    out = tmp_path / "out.json"
    assert bench_step.main(["--path", str(tmp_path), *TINY, "--steps", "2", "--warmup", "1",
                            "--configs", "none",
                            "--json", str(out)]) == 0
    assert json.loads(out.read_text())["results"]["none"]["step_s"] > 0
    assert not list(tmp_path.glob("infinity-bench-step-*"))  # its directory is removed


def test_pair_runs_the_engine_and_pytorch_in_turn_in_one_child(tmp_path):
    out = tmp_path / "out.json"
    assert bench_step.main(["--path", str(tmp_path), *TINY, "--steps", "4", "--warmup", "1",
                            "--configs", "pair",
                            "--json", str(out)]) == 0
    pair = json.loads(out.read_text())["results"]["none over torch, interleaved"]
    assert (pair["ratio"] > 0 and pair["cpu_ratio"] > 0 and pair["none_step_s"] > 0
            and pair["torch_step_s"] > 0)


def test_floor_is_the_slower_of_compute_and_io():
    def run(config, step_s, **extra):
        return [{"config": config, "step_s": step_s, "cpu_s": step_s, "peak_rss": 1e9,
                 "cores": 2, "main_runq_s": 0.1, "main_sleep_s": 0.2, **extra}]
    nvme = run("nvme", 3.0, bytes_per_step=8e9, raw_gbps=4.0, on_demand_nvme_after_step_1=0,
               compactions_per_step=2.0, compaction_s_per_step=0.01)
    results = bench_step.report({"nvme": nvme, "none": run("none", 1.5),
                                 "torch": run("torch", 1.0)})
    assert results["nvme"]["compactions_per_step"] == 2.0
    assert results["nvme over floor (none compute)"] == {"floor_s": 2.0, "io_s": 2.0, "ratio": 1.5}
    assert results["nvme over floor (torch compute)"]["floor_s"] == 2.0
    assert results["none over torch"]["ratio"] == results["none over torch"]["cpu_ratio"] == 1.5
    slow = bench_step.report({"nvme": nvme, "none": run("none", 2.5)})
    assert slow["nvme over floor (none compute)"]["floor_s"] == 2.5  # compute-bound


def test_nvme_fp32_is_the_uncompressed_baseline_of_the_same_parameters(tmp_path):
    args = bench_step.parse_args(["--path", str(tmp_path), *TINY, "--steps", "2", "--warmup", "1",
                                  "--bf16", "--optimizer-state", "int8", "--no-master"])
    compressed = bench_step.engine_config(args, "nvme", str(tmp_path))
    baseline = bench_step.engine_config(args, "nvme-fp32", str(tmp_path))
    assert compressed["infinity"]["optimizer_state"] == {"moments": "int8", "master": "none"}
    assert baseline["infinity"]["optimizer_state"] == {"moments": "fp32", "master": "fp32"}
    assert baseline["bf16"] == {"enabled": True}
    assert baseline["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    assert compressed["infinity"]["host_memory_budget"] == "auto"  # its rest caches
    small = bench_step.parse_args(["--path", str(tmp_path), "--host-memory", "1.5GB"])
    assert bench_step.engine_config(small, "nvme", str(tmp_path))["infinity"][
        "host_memory_budget"] == 1_500_000_000
    assert bench_step.engine_config(small, "none", str(tmp_path))["infinity"][
        "host_memory_budget"] == "auto"  # it holds the whole model in RAM
    fp32 = bench_step.run_child(args, "nvme-fp32", str(tmp_path))
    int8 = bench_step.run_child(args, "nvme", str(tmp_path))
    assert fp32["raw_gbps"] > 0 and fp32["bytes_per_step"] > int8["bytes_per_step"] > 0


def _floored(config, step_s, bytes_per_step, raw_gbps, cpu_s=None):
    return [{"config": config, "step_s": step_s, "cpu_s": step_s if cpu_s is None else cpu_s,
             "peak_rss": 1e9, "cores": 2, "main_runq_s": None, "main_sleep_s": None,
             "bytes_per_step": bytes_per_step, "raw_gbps": raw_gbps,
             "on_demand_nvme_after_step_1": 0, "compactions_per_step": 0.0,
             "compaction_s_per_step": 0.0}]


def test_each_floored_config_is_reported_against_its_own_io_floor():
    results = bench_step.report({"nvme": _floored("nvme", 3.0, 4e9, 2.0),
                                 "nvme-fp32": _floored("nvme-fp32", 12.0, 16e9, 1.6)})
    assert results["nvme over its I/O floor"] == {"io_s": 2.0, "ratio": 1.5}
    assert results["nvme-fp32 over its I/O floor"] == {"io_s": 10.0, "ratio": 1.2}
    assert results["nvme-fp32 over nvme"] == {"speedup": 4.0, "range": "4-4", "byte_ratio": 4.0}
    assert results["nvme"]["main_runq_s"] is None  # a kernel without schedstat: said, not 0


def test_the_own_floor_is_the_slower_of_io_and_the_cpu_seconds_over_the_cores():
    """4.4 CPU seconds a step on 2 cores cannot take less than 2.2 s, whatever the disk."""
    cpu_bound = bench_step.report({"nvme": _floored("nvme", 3.3, 4e9, 2.0, cpu_s=4.4)})
    assert cpu_bound["nvme over its own floor"] == {
        "floor_s": pytest.approx(2.2), "bound": "CPU", "cpu_floor_s": pytest.approx(2.2),
        "ratio": pytest.approx(1.5)}
    io_bound = bench_step.report({"nvme": _floored("nvme", 3.0, 4e9, 2.0, cpu_s=2.0)})
    assert io_bound["nvme over its own floor"] == {"floor_s": 2.0, "bound": "I/O",
                                                   "cpu_floor_s": 1.0, "ratio": 1.5}


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--path", str(tmp_path), "--configs", "nvme,cuda"])
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--path", str(tmp_path), "--steps", "2", "--warmup", "2"])
    assert bench_step.main(["--path", str(tmp_path / "missing" / "dir"), *TINY]) == 2


def test_ratios_pair_the_children_of_each_round():
    """A round on a loaded machine slows both of its children: the ratio is taken per round,
    not between medians that may come from different rounds."""
    def rounds(config, *steps):
        return [{"config": config, "step_s": t, "cpu_s": 1.0, "peak_rss": 1e9,
                 "main_runq_s": 0.0, "main_sleep_s": 0.0} for t in steps]
    results = bench_step.report({"none": rounds("none", 1.1, 5.5, 2.2),
                                 "torch": rounds("torch", 1.0, 5.0, 6.0)})
    assert results["none over torch"]["ratio"] == pytest.approx(1.1)  # medians: 2.2 / 5.0
    assert results["none over torch"]["range"] == "0.367-1.1"
    assert results["none over torch"]["cpu_ratio"] == 1.0


def test_children_get_the_openmp_wait_policy_asked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert bench_step.child_env(
        bench_step.parse_args(["--path", str(tmp_path)]))["OMP_WAIT_POLICY"] == "passive"
    inherit = bench_step.parse_args(["--path", str(tmp_path), "--omp-wait-policy", "inherit"])
    assert bench_step.child_env(inherit)["OMP_WAIT_POLICY"] == "active"


def test_the_clipped_configs_speculate_roll_back_or_step_after_backward(tmp_path):
    """nvme-clip clips at --clip, nvme-rollback always (every speculated unit rolled back),
    nvme-clip-after at --clip without overlapping; each is reported against nvme, per round."""
    args = bench_step.parse_args(["--path", str(tmp_path), "--clip", "1.0"])
    configs = {c: bench_step.engine_config(args, c, str(tmp_path))
               for c in ("nvme", *bench_step.CLIPPED)}
    assert [c["gradient_clipping"] for c in configs.values()] == [0.0, 1.0, 1e-9, 1.0]
    assert [c["infinity"].get("overlap_optimizer") for c in configs.values()] == \
        [None, None, None, False]
    assert [c["infinity"].get("speculate") for c in configs.values()] == \
        [None, None, "always", None]
    assert all(c["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
               for c in configs.values())

    def rounds(config, *steps):
        return [{"config": config, "step_s": t, "cpu_s": t, "peak_rss": 1e9, "cores": 2,
                 "main_runq_s": 0.0, "main_sleep_s": 0.0,
                 "optimizer": {"rollbacks": 3, "units_speculated": 9, "steps_not_speculated": 0},
                 "bytes_per_step": 1e9,
                 "raw_gbps": 1.0, "on_demand_nvme_after_step_1": 0, "compactions_per_step": 0,
                 "compaction_s_per_step": 0.0} for t in steps]
    results = bench_step.report({"nvme": rounds("nvme", 1.0, 2.0),
                                 "nvme-rollback": rounds("nvme-rollback", 1.5, 2.4)})
    assert results["nvme-rollback over nvme"]["ratio"] == pytest.approx(1.35)
    assert results["nvme-rollback over nvme"]["rollbacks"] == [3, 3]
    assert results["nvme-rollback over nvme"]["steps_not_speculated"] == [0, 0]


@pytest.mark.parametrize("size", ["banana", "0", "-1GB"])
def test_a_bad_host_memory_is_refused_in_one_line(size, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_step.parse_args(["--path", "/tmp", f"--host-memory={size}"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "--host-memory" in err[-1] and repr(size) in err[-1] and "is not a size" in err[-1]
