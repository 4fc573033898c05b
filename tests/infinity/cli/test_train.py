"""infinity-train end to end: the default run learns, --model/--data/--lora runs export a
loadable model, Ctrl-C stops cleanly with exit 0 and a checkpoint, --save-every + --resume
continue bit-identically, bad input gives one line and exit 2 with nothing left in --output."""

import json
import os
import signal
import textwrap

import pytest
import torch
import transformers
from safetensors.torch import load_file

from infinity.checkpoint import CheckpointWriter
from infinity.cli import train


def run_main(capsys, *args):
    code = train.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def test_default_run_learns_and_reports(tmp_path, capsys):
    out_dir = tmp_path / "run"
    code, out, err = run_main(capsys, "--steps", "6", "--output", str(out_dir), "--report")
    assert code == 0, err
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5  # byte-level loss starts near ln(259)
    assert all(r["nvme_gbps"] > 0 and r["rss_bytes"] > 0 and r["tokens"] == 8 * 128
               for r in records)
    # the disk under the swap file: its pauses within each step, where it has counters
    from aio.device_pauses import stat_path
    counted = stat_path(str(tmp_path)) is not None
    assert all((r["disk_paused_s"] is not None) == counted for r in records)
    assert all(0 <= r["disk_paused_s"] <= r["step_s"] + 0.2 for r in records if counted)
    assert ("disk paused" in out) == counted
    assert "fell by" in out and "loss" in err  # summary table; progress bar on stderr
    trace = json.loads((out_dir / "trace.json").read_text())
    assert {"forward", "backward"} <= {e["name"] for e in trace["traceEvents"]}
    assert (out_dir / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert ((out_dir / "config.json").exists()
            and (out_dir / "model.safetensors.index.json").exists())
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no staging directory left
    tokenizer = transformers.AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    # the ids it learned
    assert tokenizer.encode("hé", add_special_tokens=False) == list("hé".encode())


def test_model_data_and_lora_runs_export_loadable_models(tmp_path, capsys, tiny_hf_model):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} of the test text. " * 3}) + "\n"
                            for i in range(40)))
    for extra, name in (((), "full"), (("--lora", "2"), "lora")):
        code, out, err = run_main(capsys, "--model", str(tiny_hf_model), "--data", str(data),
                                  "--steps", "3",
                                  "--seq-len", "32", "--batch-size", "2", "--lr", "1e-3",
                                  "--nvme-path", str(tmp_path / "nvme"),
                                  "--output", str(tmp_path / name), *extra)
        assert code == 0, err
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name,
                                                                  local_files_only=True)
        assert not any("lora" in n for n, _ in model.named_parameters())
        assert (tmp_path / name / "tokenizer.json").exists()
    code, out, err = run_main(capsys, "--model", str(tiny_hf_model), "--data", str(data),
                              "--steps", "1",
                              "--seq-len", "32", "--lora", "2", "--lora-export", "adapter",
                              "--nvme-path", str(tmp_path / "nvme"),
                              "--output", str(tmp_path / "adapter"))
    assert code == 0, err
    assert ({"adapter_model.safetensors", "adapter_config.json", "metrics.jsonl"}
            <= set(os.listdir(tmp_path / "adapter")))
    assert os.listdir(tmp_path / "nvme") == []  # the scratch directory is gone


def test_model_streams_into_the_store_never_through_from_pretrained(tmp_path, capsys, tiny_hf_model,
                                                                   monkeypatch):
    """--model goes through infinity.models.load (the model initialize gets is the one load
    placed), with and without --lora; from_pretrained, which reads the whole model into RAM,
    is never called."""
    from infinity.train import job, models

    def whole_model_read(*args, **kwargs):
        raise AssertionError("from_pretrained called: the model would be read whole into RAM")

    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", whole_model_read)
    loaded, initialized = [], []
    real_load, real_initialize = models.load, job.initialize
    monkeypatch.setattr(models, "load",
                        lambda *a, **k: loaded.append(real_load(*a, **k)) or loaded[-1])
    monkeypatch.setattr(job, "initialize",
                        lambda m, c: initialized.append(m) or real_initialize(m, c))
    for extra in ((), ("--lora", "2")):
        code, out, err = run_main(capsys, "--model", str(tiny_hf_model), "--steps", "1",
                                  "--seq-len", "32",
                                  "--batch-size", "2", "--nvme-path", str(tmp_path / "nvme"),
                                  *extra)
        assert code == 0, err
        assert initialized[-1] is loaded[-1]
    assert [hasattr(m, "peft_config") for m in loaded] == [False, True]


def test_lora_on_a_model_directory_repeats_exactly_with_the_same_seed(tmp_path, capsys,
                                                                      tiny_hf_model):
    """The adapters' random initial values come from --seed, so two runs give the same losses
    (and another seed others)."""
    losses = {}
    for name, seed in (("a", "0"), ("b", "0"), ("c", "1")):
        code, out, err = run_main(capsys, "--model", str(tiny_hf_model), "--steps", "2",
                                  "--seq-len", "32",
                                  "--batch-size", "2", "--lr", "1e-2", "--lora", "2",
                                  "--seed", seed,
                                  "--nvme-path", str(tmp_path / "nvme"),
                                  "--output", str(tmp_path / name))
        assert code == 0, err
        losses[name] = [json.loads(line)["loss"]
                        for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert losses["a"] == losses["b"] and losses["a"] != losses["c"]


def test_a_second_ctrl_c_aborts_at_once_with_exit_130(capsys, monkeypatch):
    """The first SIGINT asks the loop to stop after its step (GracefulStop, as the job uses it);
    a second one interrupts there and then, and infinity-train exits 130."""
    from infinity.train.loop import GracefulStop

    def interrupted_twice(options, on_step):
        with GracefulStop() as stop:
            signal.raise_signal(signal.SIGINT)
            assert stop.requested  # the first one only asked
            signal.raise_signal(signal.SIGINT)
        raise AssertionError("the second SIGINT did not interrupt")

    monkeypatch.setattr(train, "run", interrupted_twice)
    code, out, err = run_main(capsys, "--steps", "1")
    assert code == 130
    assert err.strip().splitlines()[-1] == "infinity-train: aborted", err


def test_a_signal_during_a_write_to_stderr_still_asks_the_loop_to_stop(capfd, monkeypatch):
    """SIGTERM lands while the progress bar is writing to sys.stderr: the handler writes its
    line to the file descriptor, never to the stream (a second write into a buffered stream
    from a signal handler raises "reentrant call", which once ended a run)."""
    import sys

    from infinity.train.loop import GracefulStop

    class Busy:
        def write(self, text):
            raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stderr>'>")

        def flush(self):
            pass

    with GracefulStop() as stop:
        monkeypatch.setattr(sys, "stderr", Busy())
        signal.raise_signal(signal.SIGTERM)
        monkeypatch.undo()
    assert stop.requested and stop.by == "SIGTERM"
    assert "SIGTERM: stopping after this step (again to abort)" in capfd.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--model", "{tmp}/nowhere"], "--model {tmp}/nowhere: no such directory"),
    (["--data", "{tmp}/empty.txt"], "--data {tmp}/empty.txt: no text"),
    (["--seq-len", "300"], "--seq-len 300: must be between 2 and the model's 256 positions"),
    (["--model", "{model}", "--seq-len", "65"],
     "--seq-len 65: must be between 2 and the model's 64 positions"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--config", "{tmp}/bad.json"], "--config {tmp}/bad.json: not JSON"),
    (["--config", "{tmp}/unknown.json"], "unknown config key 'zero_optimization.stagee'"),
    (["--save-every", "0"], "--save-every 0: must be at least 1"),
    (["--resume"], "--resume: no checkpoint in {tmp}/out/checkpoints"),
    (["--config", "{tmp}/tiny_budget.json"],
     "host_memory_budget 4096 bytes cannot hold this model's plan"),
    (["--model", "{model}", "--seq-len", "32", "--config", "{tmp}/tiny_budget.json"],
     "host_memory_budget 4096 bytes cannot hold this model's plan"),
    (["--model", "{model}", "--seq-len", "32", "--lora", "0"],
     "--lora 0: the rank must be at least 1"),
    (["--model", "{tmp}/no_weights", "--seq-len", "32"],
     "--model {tmp}/no_weights: cannot load a causal LM ({tmp}/no_weights: no "
     "model.safetensors nor model.safetensors.index.json"),
])
def test_bad_input_one_line_exit_2_nothing_in_output(tmp_path, capsys, tiny_hf_model, args,
                                                     message):
    (tmp_path / "empty.txt").write_text("\n")
    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "unknown.json").write_text('{"zero_optimization": {"stagee": 3}}')
    (tmp_path / "tiny_budget.json").write_text('{"infinity": {"host_memory_budget": 4096}}')
    (tmp_path / "no_weights").mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "no_weights" / name).write_bytes((tiny_hf_model / name).read_bytes())
    fill = {"tmp": str(tmp_path), "model": str(tiny_hf_model)}
    code, out, err = run_main(capsys, *[a.format(**fill) for a in args],
                              "--output", str(tmp_path / "out"))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"infinity-train: error: {message.format(**fill)}"), err
    assert not any(p.name.startswith((".out", "out")) for p in tmp_path.iterdir())


def test_read_only_nvme_path_is_refused(read_only_dir, run_unprivileged):
    out = run_unprivileged(textwrap.dedent(f"""
        from infinity.cli import train
        sys.exit(train.main(["--steps", "1", "--nvme-path", {read_only_dir!r}]))
    """), preload=("infinity.cli.train", "transformers.models.llama.modeling_llama", "tokenizers",
                   "transformers.tokenization_utils_tokenizers"))
    assert out.returncode == 2, out.stderr
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith(
        f"infinity-train: error: --nvme-path {read_only_dir}: cannot write there"), out.stderr
    assert os.listdir(read_only_dir) == []


def test_help_explains_every_option_with_its_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for option in ("--model DIR", "--data PATH|ID", "--config JSON", "--nvme-path DIR",
                   "--output DIR", "--steps N", "--seq-len N", "--batch-size N", "--lr X",
                   "--save-every N", "--resume", "--lora R", "--report", "--host-memory SIZE",
                   "--text-field NAME", "--eval-data PATH|ID", "--eval-split RATIO",
                   "--eval-every N", "--warmup N|RATIO", "--schedule {constant,linear,cosine}",
                   "--grad-accum N", "--gradient-checkpointing", "--weight-decay X", "--clip X",
                   "--bf16", "--fp32", "--report-to {tensorboard}"):
        assert option in text
    for default in ("(default: 100)", "(default: 128)", "(default: 0)", "(default: 2G)", "else 8",
                    "infinity.models.load", "infinity-train --model"):
        assert default in text


def test_full_nvme_disk_is_refused(tmp_path, capsys, small_disk):
    disk = small_disk("2m")
    code, out, err = run_main(capsys, "--steps", "1", "--nvme-path", str(disk),
                              "--output", str(tmp_path / "out"))
    assert code == 2
    lines = err.strip().splitlines()
    assert (len(lines) == 1 and lines[0].startswith("infinity-train: error: disk full:")
            and "ENOSPC" in lines[0]), err
    assert os.listdir(disk) == [] and os.listdir(tmp_path) == [disk.name]


SMALL = ("--steps", "4", "--batch-size", "2", "--seq-len", "32")


def losses(out_dir):
    return {r["step"]: r["loss"]
            for r in map(json.loads, (out_dir / "metrics.jsonl").read_text().splitlines())}


def weights(out_dir):
    return load_file(out_dir / "model-00001-of-00001.safetensors")


def assert_same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert wa[name].dtype == wb[name].dtype and wa[name].equal(wb[name]), name


def test_save_every_and_resume_equals_one_run(tmp_path, capsys):
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    assert run_main(capsys, *SMALL, "--output", str(whole))[0] == 0
    code, out, err = run_main(capsys, *SMALL[:1], "2", *SMALL[2:], "--save-every", "1",
                              "--output", str(halves))
    assert code == 0, err
    assert sorted(os.listdir(halves / "checkpoints")) == ["latest", "step1", "step2"]
    # a job that died after step 3 without a checkpoint left a line the resumed run redoes
    with open(halves / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "loss": 0.0}) + "\n")
    code, out, err = run_main(capsys, *SMALL, "--save-every", "3", "--output", str(halves),
                              "--resume")
    assert code == 0, err
    assert losses(halves) == losses(whole)  # exactly: the second half took the same batches
    assert list(losses(halves)) == [1, 2, 3, 4]
    assert_same_weights(halves, whole)
    # every 3rd step and the last: a run that ends leaves a checkpoint of where it ended
    assert sorted(os.listdir(halves / "checkpoints")) == ["latest", "step1", "step2", "step3",
                                                          "step4"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_sigint_finishes_the_step_saves_exports_and_resume_continues(tmp_path, capsys,
                                                                      monkeypatch):
    """Ctrl-C (SIGINT raised in this process during step 2's backward) finishes the step, saves
    a checkpoint, exports the model and exits 0; --resume then continues from that checkpoint.
    (A signal from another process: the SIGTERM test in test_train_runs.py.)"""
    from infinity.engine._engine import Engine

    backward, calls = Engine.backward, []

    def backward_interrupted_in_step_2(engine, loss):
        calls.append(engine.global_steps)
        if engine.global_steps == 1 and calls.count(1) == 1:
            signal.raise_signal(signal.SIGINT)
        return backward(engine, loss)

    monkeypatch.setattr(Engine, "backward", backward_interrupted_in_step_2)
    out_dir = tmp_path / "run"
    code, out, err = run_main(capsys, "--steps", "2000", "--batch-size", "2", "--seq-len", "32",
                              "--output", str(out_dir))
    assert code == 0, err
    assert "stopped early by Ctrl-C" in out
    assert list(losses(out_dir)) == [1, 2]  # the step in progress was finished, no other begun
    assert f"last checkpoint {out_dir / 'checkpoints' / 'step2'} (continue" in out
    assert (out_dir / "checkpoints" / "latest").read_text().strip() == "step2"
    assert (out_dir / "model.safetensors.index.json").exists()
    monkeypatch.setattr(Engine, "backward", backward)
    code, out, err = run_main(capsys, "--steps", "4", "--batch-size", "2", "--seq-len", "32",
                              "--output", str(out_dir), "--resume")
    assert code == 0, err
    assert list(losses(out_dir)) == [1, 2, 3, 4]


def test_checkpoint_options_bad_input(tmp_path, capsys):
    cases = [
        ((*SMALL, "--save-every", "2"), "--save-every needs --output"),
        ((*SMALL, "--resume"), "--resume needs --output"),
        ((*SMALL, "--resume", "--output", str(tmp_path / "none")),
         f"--resume: no checkpoint in {tmp_path / 'none' / 'checkpoints'}"),
    ]
    for args, message in cases:
        code, out, err = run_main(capsys, *args)
        assert code == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"infinity-train: error: {message}"), err
    assert os.listdir(tmp_path) == []
    run_dir = tmp_path / "run"
    assert run_main(capsys, "--steps", "1", "--batch-size", "2", "--seq-len", "32",
                    "--save-every", "1",
                    "--output", str(run_dir))[0] == 0
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    for args, message in [
        (("--steps", "1", "--resume"), "--resume: the checkpoint is at step 1, --steps 1"),
        (("--steps", "3", "--resume", "--batch-size", "3"),
         "--resume: the checkpoint at step 1 was made with --batch-size 2, this run has 3"),
        (("--steps", "3", "--resume", "--seed", "1"),
         "--resume: the checkpoint at step 1 was made with --seed 0, this run has 1"),
        (("--steps", "3", "--resume", "--seq-len", "16"),  # the rows are cut anew: more of them
         "--resume: the checkpoint at step 1 was made with --seq-len 32, this run has 16"),
        (("--steps", "3", "--resume", "--lora", "2"),
         f"--resume: checkpoint {run_dir / 'checkpoints' / 'step1'} "
         "has no parameter"),  # another model
        (("--steps", "3"),
         f"--output {run_dir}: exists and is not an empty directory (it holds checkpoints: "
         "add --resume"),
    ]:
        code, out, err = run_main(capsys, "--batch-size", "2", "--seq-len", "32", *args,
                                  "--output", str(run_dir))
        assert code == 2
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"infinity-train: error: {message}"), err
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before  # untouched
    foreign = tmp_path / "foreign"
    with CheckpointWriter(foreign / "checkpoints", "step1", metadata={}) as writer:
        writer.add("w", torch.zeros(2))
    code, out, err = run_main(capsys, *SMALL, "--output", str(foreign), "--resume")
    assert code == 2 and err.strip() == (
        f"infinity-train: error: --resume: checkpoint {foreign}/checkpoints/step1 "
        "was not written by infinity-train (no step and data position in its "
        "client_state)"), err
