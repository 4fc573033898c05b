"""The job's config assembly: the file (or the shipped default), then the command-line options;
the scratch directory made lazily and removed; --output staged and renamed only when complete."""

import json

import pytest

from infinity.errors import InputError
from infinity.train.config import ds_config
from infinity.train.job import TrainOptions, run
from infinity.train.outputs import scratch_dir, staged_output


def test_shipped_config_gets_the_scratch_directory_and_defaults():
    config = ds_config(TrainOptions(), lambda: "/scratch")
    zero = config["zero_optimization"]
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": "/scratch"}
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": "/scratch"}
    assert (config["train_micro_batch_size_per_gpu"] == 8
            and config["optimizer"]["params"]["lr"] == 3e-3)


def test_options_override_the_config_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "eps": 1e-6}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/mine"},
                              "offload_optimizer": {"device": "cpu"}}}))
    kept = ds_config(TrainOptions(config=str(path)), lambda: pytest.fail("no scratch needed"))
    assert (kept["train_batch_size"] == 32
            and kept["zero_optimization"]["offload_param"]["nvme_path"] == "/mine")
    given = ds_config(TrainOptions(config=str(path), batch_size=2, lr=5e-5, nvme_path="/fast"),
                      lambda: "/fast/tmp1")
    assert given["train_micro_batch_size_per_gpu"] == 2 and "train_batch_size" not in given
    assert given["optimizer"]["params"] == {"lr": 5e-5, "eps": 1e-6}
    assert given["zero_optimization"]["offload_param"]["nvme_path"] == "/fast/tmp1"
    assert given["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}


def test_config_file_errors_name_it(tmp_path):
    with pytest.raises(InputError, match="--config .*missing.json: No such file"):
        ds_config(TrainOptions(config=str(tmp_path / "missing.json")), str)
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(InputError, match="not a JSON object"):
        ds_config(TrainOptions(config=str(tmp_path / "list.json")), str)


def test_scratch_is_made_only_when_asked_and_removed(tmp_path):
    with scratch_dir(str(tmp_path / "nvme")) as get:
        assert not (tmp_path / "nvme").exists()
        made = get()
        assert get() == made and made.startswith(str(tmp_path / "nvme"))
        (tmp_path / "nvme" / made / "swap").write_bytes(b"x")
    assert list((tmp_path / "nvme").iterdir()) == []


def test_output_appears_only_when_complete(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), staged_output(str(out)) as staging:
        (staging.path / "half.safetensors").write_bytes(b"x")
        assert not out.exists()
        raise RuntimeError("export failed")
    assert list(tmp_path.iterdir()) == []
    out.mkdir()  # an empty directory may be the target
    with staged_output(str(out)) as staging:
        (staging.path / "model.safetensors").write_bytes(b"x")
    assert ([p.name for p in out.iterdir()] == ["model.safetensors"]
            and list(tmp_path.iterdir()) == [out])
    with (pytest.raises(InputError, match="exists and is not an empty directory"),
          staged_output(str(out))):
        pass


def test_output_published_at_the_first_checkpoint_outlives_a_failure(tmp_path):
    """Once a checkpoint is saved, --output must keep it (to be resumed) whatever happens next."""
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), staged_output(str(out)) as staging:
        with (staging.path / "metrics.jsonl").open("w") as metrics:
            metrics.write("step 1\n")
            staging.publish()  # what the first checkpoint save does
            (staging.path / "checkpoints").mkdir()
            metrics.write("step 2\n")  # the open file moved with the directory
        raise RuntimeError("training failed at step 3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert ((out / "metrics.jsonl").read_text() == "step 1\nstep 2\n"
            and (out / "checkpoints").is_dir())
    with staged_output(str(out), resume=True) as resumed:  # --resume works in --output itself
        assert resumed.path == out
        (out / "model.safetensors").write_bytes(b"x")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "metrics.jsonl",
                                                     "model.safetensors"]


def test_the_shipped_budget_follows_the_machine_and_host_memory_sets_it():
    """The shipped config's budget is "auto" (a share of the memory available, as the config
    means it); --host-memory sets it in the config's own units."""
    from infinity.cli.args import parse_size
    from infinity.config import load_config

    shipped = ds_config(TrainOptions(), lambda: "/scratch")
    assert shipped["infinity"]["host_memory_budget"] == "auto"
    assert load_config({**shipped, "zero_optimization": {}}).infinity.host_memory_budget > 256e6
    given = ds_config(TrainOptions(host_memory=parse_size("2GB")), lambda: "/scratch")
    config = load_config({**given, "zero_optimization": {}})
    assert config.infinity.host_memory_budget == 2_000_000_000 == parse_size("2GB")


def _bf16_model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    return str(tmp_path)


@pytest.mark.parametrize("fast", [True, False])
def test_a_bf16_model_trains_in_bf16_where_the_machine_computes_it_fast(tmp_path, monkeypatch,
                                                                        fast):
    from infinity.train import config as train_config

    monkeypatch.setattr(train_config, "bf16_is_fast", lambda: fast)
    chosen = ds_config(TrainOptions(model=_bf16_model(tmp_path)), lambda: "/scratch")
    assert chosen.get("bf16", {}).get("enabled", False) is fast
    builtin = ds_config(TrainOptions(), lambda: "/scratch")  # an fp32 model stays fp32
    assert "bf16" not in builtin
    for flag, enabled in (("bf16", True), ("fp32", False)):
        forced = ds_config(TrainOptions(model=_bf16_model(tmp_path), precision=flag), lambda: "/s")
        assert forced["bf16"] == {"enabled": enabled} and forced["fp16"] == {"enabled": False}


def test_the_config_files_precision_is_kept(tmp_path, monkeypatch):
    from infinity.train import config as train_config

    monkeypatch.setattr(train_config, "bf16_is_fast", lambda: True)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": False}}))
    kept = ds_config(TrainOptions(model=_bf16_model(tmp_path), config=str(path)), lambda: "/s")
    assert kept["bf16"] == {"enabled": False}


def test_the_cpu_probe_is_what_decides_on_a_cpu(monkeypatch):
    from infinity.train import config as train_config

    monkeypatch.setattr(train_config.torch.cuda, "is_available", lambda: False)
    for has_units in (True, False):
        monkeypatch.setattr(train_config, "cpu_has_bf16_units", lambda has=has_units: has)
        assert train_config.bf16_is_fast() is has_units


@pytest.mark.parametrize("schedule, kind", [("constant", "WarmupLR"), ("linear", "WarmupDecayLR"),
                                            ("cosine", "WarmupCosineLR")])
def test_schedule_and_warmup_flags_build_the_scheduler(schedule, kind):
    config = ds_config(TrainOptions(steps=200, schedule=schedule, warmup="0.05"), str)
    assert config["scheduler"]["type"] == kind
    assert config["scheduler"]["params"]["warmup_num_steps"] == 10  # 5% of --steps
    assert config["scheduler"]["params"]["warmup_type"] == "linear"  # what --help says
    total = config["scheduler"]["params"].get("total_num_steps")
    assert total == (None if kind == "WarmupLR" else 200)
    steps = ds_config(TrainOptions(steps=200, warmup="7"), str)  # a warmup alone: constant after it
    assert steps["scheduler"] == {"type": "WarmupLR", "params": {
        "warmup_num_steps": 7, "warmup_type": "linear", "warmup_min_lr": 0,
        "warmup_max_lr": "auto"}}  # up to the lr


def test_a_config_schedule_with_auto_total_steps_takes_steps(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": "auto", "warmup_num_steps": 3}}}))
    config = ds_config(TrainOptions(config=str(path), steps=40), str)
    assert config["scheduler"]["params"] == {"total_num_steps": 40, "warmup_num_steps": 3}


@pytest.mark.parametrize("warmup", ["-1", "1.5", "x", "2.0"])
def test_bad_warmup_is_refused(warmup):
    with pytest.raises(InputError, match=f"--warmup {warmup}: steps"):
        ds_config(TrainOptions(warmup=warmup), str)


def test_training_flags_reach_the_config():
    config = ds_config(TrainOptions(grad_accum=4, weight_decay=0.1, clip=1.0, batch_size=2), str)
    assert config["gradient_accumulation_steps"] == 4 and "train_batch_size" not in config
    assert config["optimizer"]["params"]["weight_decay"] == 0.1
    assert config["optimizer"]["params"]["lr"] == 3e-3  # the shipped config's, kept
    assert config["gradient_clipping"] == 1.0
    with pytest.raises(InputError, match="--grad-accum 0: must be at least 1"):
        ds_config(TrainOptions(grad_accum=0), str)


def test_optimizer_state_options_land_in_the_infinity_section(tmp_path):
    from infinity.config import load_config

    given = ds_config(TrainOptions(model=_bf16_model(tmp_path), precision="bf16",
                                   optimizer_state="int8", no_master=True), lambda: "/s")
    assert given["infinity"]["optimizer_state"] == {"moments": "int8", "master": "none"}
    state = load_config({**given, "zero_optimization": {}}).infinity.optimizer_state
    assert (state.moments, state.master) == ("int8", "none")
    assert "optimizer_state" not in ds_config(TrainOptions(), lambda: "/s")["infinity"]
    with pytest.raises(InputError, match="--no-master: this run trains in fp32"):
        ds_config(TrainOptions(no_master=True), lambda: "/s")
    with pytest.raises(InputError, match="--optimizer-state int4: choose one of fp32, bf16"):
        ds_config(TrainOptions(optimizer_state="int4"), lambda: "/s")


@pytest.mark.parametrize("options, message", [
    (dict(lora_export="lora"), "--lora-export lora: choose one of merged, adapter"),
    (dict(report_to=("wandb",), output="out"), "--report-to wandb: choose from tensorboard"),
    (dict(eval_every=0, eval_split=0.1), "--eval-every 0: must be at least 1"),
    (dict(report=True), "--report needs --output"),
])
def test_options_the_command_line_cannot_give_are_refused_by_the_api_too(tmp_path, options,
                                                                          message):
    """A caller of `job.run` skips argparse's choices: the same values are one InputError,
    before anything is written."""
    if "output" in options:
        options["output"] = str(tmp_path / options["output"])
    with pytest.raises(InputError, match=message):
        run(TrainOptions(**options))
    assert list(tmp_path.iterdir()) == []


def test_the_report_history_skips_what_is_not_a_step_record(tmp_path):
    """metrics.jsonl after a crash or a hand edit: a torn last line, garbage, bytes that are
    not UTF-8, a record without an integer step; none of them stops --report."""
    from infinity.train import report

    metrics = tmp_path / "metrics.jsonl"
    assert report.read_history(metrics) == []  # no file yet
    metrics.write_bytes(b'{"step": 1, "loss": 2.0}\ngarbage\n[1]\n{"step": "2"}\n\xff\xfe\n'
                        b'{"step": 3, "loss": 1.5}\n{"step": 4, "lo')
    assert report.read_history(metrics) == [{"step": 1, "loss": 2.0}, {"step": 3, "loss": 1.5}]


def test_the_swap_file_leaves_room_for_the_export_on_its_disk(tmp_path, monkeypatch):
    """--output on the disk of the swap file: the engine is told about what the export will
    write (infinity.nvme_keep_free), so the speculated step's room gives way to it."""
    from infinity.engine import _placement
    seen = []
    fit = _placement.fit_nvme_budget

    def spy(budget, kept, free, keep_free=0):
        seen.append(keep_free)
        return fit(budget, kept, free, keep_free)

    monkeypatch.setattr(_placement, "fit_nvme_budget", spy)
    out = tmp_path / "out"
    run(TrainOptions(steps=1, output=str(out), nvme_path=str(tmp_path / "nvme")))
    written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert len(seen) == 1 and 0 < seen[0] <= written < seen[0] + (64 << 10)  # + the header


def test_room_for_the_export_is_kept_only_on_the_swap_files_disk(tmp_path):
    from infinity.train.config import keep_room_for_export
    (tmp_path / "nvme").mkdir()
    nvme = {"device": "nvme", "nvme_path": str(tmp_path / "nvme")}
    config = {"zero_optimization": {"offload_param": {"device": "cpu"},
                                    "offload_optimizer": nvme}}
    keep_room_for_export(config, tmp_path, 1234)
    assert config["infinity"] == {"nvme_keep_free": 1234}
    keep_room_for_export(config, tmp_path, 99)  # the config's own value stands
    assert config["infinity"] == {"nvme_keep_free": 1234}
    for zero in ({}, {"offload_optimizer": {"device": "cpu"}},
                 {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "no")}}):
        config = {"zero_optimization": zero}
        keep_room_for_export(config, tmp_path, 1234)
        assert "nvme_keep_free" not in config.get("infinity", {})
    # sections that are no objects, a path that is no string (os.stat would take 0 as a file
    # descriptor): left to the engine, which names them
    fd_path = {"offload_optimizer": {"device": "nvme", "nvme_path": 0}}
    for config in ({"infinity": 5}, {"zero_optimization": 3},
                   {"infinity": {}, "zero_optimization": fd_path}):
        before = json.loads(json.dumps(config))
        keep_room_for_export(config, tmp_path, 1234)
        assert config == before


def test_a_config_section_that_is_no_object_is_one_line_not_a_traceback(tmp_path, capsys):
    config = tmp_path / "bad.json"
    config.write_text('{"infinity": 5}')
    from infinity.cli.train import main
    assert main(["--steps", "1", "--config", str(config), "--output", str(tmp_path / "out"),
                 "--nvme-path", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "infinity" in err[0], err
