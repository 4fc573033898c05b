"""The job's config assembly: the file (or the shipped default), then the command-line options;
the scratch directory made lazily and removed; --output staged and renamed only when complete."""

import json

import pytest

from infinity.errors import InputError
from infinity.train.job import TrainOptions, ds_config, scratch_dir, staged_output


def test_shipped_config_gets_the_scratch_directory_and_defaults():
    config = ds_config(TrainOptions(), lambda: "/scratch")
    zero = config["zero_optimization"]
    assert zero["offload_param"] == {"device": "nvme", "nvme_path": "/scratch"}
    assert zero["offload_optimizer"] == {"device": "nvme", "nvme_path": "/scratch"}
    assert config["train_micro_batch_size_per_gpu"] == 8 and config["optimizer"]["params"]["lr"] == 3e-3


def test_options_override_the_config_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "eps": 1e-6}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/mine"},
                              "offload_optimizer": {"device": "cpu"}}}))
    kept = ds_config(TrainOptions(config=str(path)), lambda: pytest.fail("no scratch needed"))
    assert kept["train_batch_size"] == 32 and kept["zero_optimization"]["offload_param"]["nvme_path"] == "/mine"
    given = ds_config(TrainOptions(config=str(path), batch_size=2, lr=5e-5, nvme_path="/fast"), lambda: "/fast/tmp1")
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
    assert [p.name for p in out.iterdir()] == ["model.safetensors"] and list(tmp_path.iterdir()) == [out]
    with pytest.raises(InputError, match="exists and is not an empty directory"), staged_output(str(out)):
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
    assert (out / "metrics.jsonl").read_text() == "step 1\nstep 2\n" and (out / "checkpoints").is_dir()
    with staged_output(str(out), resume=True) as resumed:  # --resume works in --output itself
        assert resumed.path == out
        (out / "model.safetensors").write_bytes(b"x")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "metrics.jsonl", "model.safetensors"]
