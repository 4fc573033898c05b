"""infinity-train's options for real fine-tuning: evaluation, chat data, the schedule and
training flags, metric writers, the tokenized-data cache on --resume, the report, and the
messages a user meets (the config line once with -v, --resume with another --seq-len, the
adapter of the built-in model)."""

import json
import logging
import math
import shutil

import pytest
import torch
from chat_data import CHAT, TEMPLATE

from infinity.cli import train
from infinity.train import data as train_data
from infinity.train import report

SMALL = ("--batch-size", "2", "--seq-len", "32")


def run_main(capsys, *args):
    code = train.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def metrics(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_evaluation_reports_loss_and_perplexity(tmp_path, capsys):
    out = tmp_path / "run"
    code, stdout, err = run_main(capsys, "--steps", "4", *SMALL, "--eval-split", "0.05",
                                 "--eval-every", "2", "--output", out, "--report")
    assert code == 0, err
    lines = metrics(out)
    evaluated = {r["step"]: r["eval_loss"] for r in lines if r["eval_loss"] is not None}
    assert list(evaluated) == [2, 4]
    assert all(math.isclose(r["eval_perplexity"], math.exp(r["eval_loss"])) for r in lines
               if r["eval_loss"] is not None)
    assert evaluated[4] < evaluated[2]  # it learns
    assert f"eval loss     {evaluated[2]:.4f} -> {evaluated[4]:.4f} (perplexity" in stdout
    assert "eval " in err and "(ppl " in err  # on the progress bar


def test_evaluation_is_a_forward_pass_without_the_optimizer(tmp_path):
    """The eval pass runs through the engine in eval mode without gradients: no optimizer step,
    no parameter changes, the same loss as a plain forward of the same weights."""
    import infinity
    from infinity.train.loop import evaluate
    from infinity.train.models import DEFAULTS, default_model

    model, tokenizer = default_model()
    reference = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows = train_data.pack(iter(["an evaluation text, " * 40]), tokenizer, 32, source="x")
    with torch.no_grad():
        batch = train_data.as_batch(rows)
        expected = float(model(input_ids=batch.ids, labels=batch.labels).loss)
    config = json.loads((DEFAULTS / "ds_config.json").read_text())
    for key in ("offload_param", "offload_optimizer"):
        config["zero_optimization"][key]["nvme_path"] = str(tmp_path)
    with infinity.initialize(model, config) as engine:
        loss, tokens = evaluate(engine, rows, batch_size=len(rows))
        assert engine.global_steps == 0 and engine.module.training
        assert all(torch.equal(values, reference[name])
                   for name, values in engine.named_parameters())
    assert tokens == batch.trained_tokens and loss == pytest.approx(expected, rel=1e-5)


def test_eval_options_that_cannot_work_are_refused(tmp_path, capsys):
    for args, message in [(("--eval-every", "2"), "--eval-every needs --eval-data or --eval-split"),
                          (("--eval-split", "0.1", "--eval-data", tmp_path),
                           "--eval-data and --eval-split"),
                          (("--eval-split", "2"), "--eval-split 2.0: a share"),
                          (("--report",), "--report needs --output"),
                          (("--report-to", "tensorboard"), "--report-to needs --output")]:
        code, _, err = run_main(capsys, "--steps", "1", *args)
        assert code == 2 and err.startswith(f"infinity-train: error: {message}"), err


def test_a_torchrun_rank_is_refused_before_it_runs_the_whole_job(tmp_path, capsys, monkeypatch):
    """Each rank used to run the whole job: the first to take --output refused the others with
    "in use by another infinity-train run", naming its sibling rank."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, _, err = run_main(capsys, "--steps", "1", "--output", tmp_path / "run")
    assert code == 2 and err.startswith("infinity-train: error: 2 ranks (WORLD_SIZE): "
                                        "infinity-train trains in one process"), err
    assert not (tmp_path / "run").exists()


@pytest.fixture
def chat_model(tmp_path, tiny_hf_model):
    directory = tmp_path / "chat-model"
    shutil.copytree(tiny_hf_model, directory)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings["chat_template"] = TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


def test_chat_data_trains_on_assistant_tokens_and_counts_them(tmp_path, capsys, chat_model):
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(40)))
    out = tmp_path / "run"
    code, stdout, err = run_main(capsys, "--model", chat_model, "--data", data, "--steps", "2",
                                 *SMALL, "--nvme-path", tmp_path / "nvme", "--output", out)
    assert code == 0, err
    per_step = [r["trained_tokens"] for r in metrics(out)]
    assert all(0 < n < 2 * 31 for n in per_step)  # the prompts are masked
    assert f"{sum(per_step)} of them trained" in stdout


def test_schedule_warmup_and_accumulation_reach_the_steps(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_main(capsys, "--steps", "6", *SMALL, "--grad-accum", "2", "--schedule",
                            "linear", "--warmup", "2", "--lr", "1e-2", "--clip", "1.0",
                            "--output", out)
    assert code == 0, err
    lines = metrics(out)
    lrs = [r["lr"] for r in lines]
    assert lrs[0] == 0.0 and max(lrs) == pytest.approx(1e-2)  # warmed up from 0
    assert lrs[-1] < lrs[-2] < max(lrs)  # then down, linearly to 0 at --steps
    assert all(r["tokens"] == 2 * 2 * 32 for r in lines)  # two micro-batches a step
    assert all(r["grad_norm"] > 0 for r in lines)  # clipping takes the norm


def test_gradient_checkpointing_gives_the_same_losses(tmp_path, capsys):
    losses = {}
    for name, extra in (("plain", ()), ("recomputed", ("--gradient-checkpointing",))):
        code, _, err = run_main(capsys, "--steps", "2", *SMALL, *extra, "--output", tmp_path / name)
        assert code == 0, err
        losses[name] = [r["loss"] for r in metrics(tmp_path / name)]
    assert losses["recomputed"] == pytest.approx(losses["plain"], rel=1e-5)


class StandIn:
    """A TensorBoard SummaryWriter's surface, recording what it is given."""

    def __init__(self, logdir):
        self.logdir, self.scalars, self.closed = logdir, [], False

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))

    def flush(self):
        pass

    def close(self):
        self.closed = True


def test_report_to_tensorboard_writes_every_step(tmp_path, capsys, monkeypatch):
    made = []
    monkeypatch.setattr(report, "tensorboard_writer",
                        lambda logdir: made.append(StandIn(logdir)) or made[-1])
    out = tmp_path / "run"
    code, _, err = run_main(capsys, "--steps", "2", *SMALL, "--eval-split", "0.1", "--output", out,
                            "--report-to", "tensorboard")
    assert code == 0, err
    [writer] = made
    assert writer.closed and str(writer.logdir).endswith("tensorboard")
    tags = {(tag, step) for tag, _, step in writer.scalars}
    assert {("train/loss", 1), ("train/loss", 2), ("train/lr", 1), ("speed/tokens_per_s", 2),
            ("eval/loss", 2), ("eval/perplexity", 2)} <= tags
    assert ("eval/loss", 1) not in tags  # evaluated after the last step only
    from aio.device_pauses import stat_path
    if stat_path(str(tmp_path)) is not None:  # the disk under the swap file has counters
        assert {("speed/disk_paused_s", 1), ("speed/disk_paused_s", 2)} <= tags


def test_the_real_tensorboard_writer_when_installed(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    code, _, err = run_main(capsys, "--steps", "1", *SMALL, "--output", out, "--report-to",
                            "tensorboard")
    assert code == 0, err
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))


def test_tensorboard_absent_is_one_line(tmp_path, capsys, monkeypatch, caplog):
    import builtins

    real_import = builtins.__import__

    def no_tensorboard(name, *args, **kwargs):
        if name.startswith("torch.utils.tensorboard") or name == "tensorboard":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_tensorboard)
    code, _, err = run_main(capsys, "--steps", "1", *SMALL, "--output", tmp_path / "run",
                            "--report-to", "tensorboard")
    assert code == 2 and err.strip() == ("infinity-train: error: --report-to tensorboard needs the "
                                         "tensorboard package (pip install tensorboard)")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"tensorboard": {"enabled": True}, "wandb": {"enabled": True}}))
    with caplog.at_level(logging.WARNING, logger="infinity.train"):
        code, _, err = run_main(capsys, "--steps", "1", *SMALL, "--config", config, "--output",
                                tmp_path / "r2")
    assert code == 0, err
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("wandb.enabled is not honoured by infinity-train" in w for w in warnings)
    assert any("tensorboard.enabled is not honoured: the tensorboard package is not installed" in w
               for w in warnings)


def test_resume_takes_the_cached_tokens_and_names_a_changed_seq_len(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert run_main(capsys, "--steps", "1", *SMALL, "--save-every", "1", "--output", out)[0] == 0
    assert len(list((out / "cache").glob("tokens-*.safetensors"))) == 1

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(train_data, "tokenize", no_tokenizing)
    code, _, err = run_main(capsys, "--steps", "2", *SMALL, "--save-every", "1", "--output", out,
                            "--resume")
    assert code == 0, err
    monkeypatch.undo()
    code, _, err = run_main(capsys, "--steps", "3", "--batch-size", "2", "--seq-len", "16",
                            "--output", out, "--resume")
    assert code == 2 and err.startswith("infinity-train: error: --resume: the checkpoint at step 2 "
                                        "was made with --seq-len 32, this run has 16"), err


def test_verbose_prints_the_config_line_once(tmp_path, tiny_hf_model, capsys):
    """models.load reads the config twice on its way into initialize, which reads it again:
    the config's line is printed once (it was three times). The root logger starts as in a
    fresh process (no handler), so -v's logging set-up is the one that prints."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    root.handlers.clear()
    try:
        code, _, err = run_main(capsys, "--model", tiny_hf_model, "--steps", "1", *SMALL, "-v",
                                "--nvme-path", tmp_path)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert code == 0, err
    assert sum("config: filled" in line for line in err.splitlines()) == 1, err


def test_an_adapter_of_the_built_in_model_comes_with_its_base(tmp_path, capsys):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "run"
    code, stdout, err = run_main(capsys, "--steps", "2", *SMALL, "--lora", "2", "--lora-export",
                                 "adapter", "--lr", "1e-2", "--output", out)
    assert code == 0, err
    assert f"the adapter's base is the built-in model (seed 0), written to {out / 'base'}" in stdout
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(out / "base")
    base = transformers.AutoModelForCausalLM.from_pretrained(out / "base")
    ids = torch.arange(32).view(1, 32)
    with torch.no_grad():
        before = base(input_ids=ids).logits
        tuned = peft.PeftModel.from_pretrained(base, out)(input_ids=ids).logits
    assert not torch.allclose(tuned, before)  # the trained adapters on their base


def test_the_report_plots_the_whole_history(tmp_path, capsys):
    out = tmp_path / "run"
    assert run_main(capsys, "--steps", "2", *SMALL, "--save-every", "1", "--output", out)[0] == 0
    code, _, err = run_main(capsys, "--steps", "4", *SMALL, "--output", out, "--resume", "--report")
    assert code == 0, err
    history = report.read_history(out / "metrics.jsonl")
    assert [r["step"] for r in history] == [1, 2, 3, 4]
    figure = report.figure(history, budgets={"host": 5 << 20, "nvme": 30 << 20})
    labels = {ax.get_ylabel(): ax for ax in figure.axes}
    assert {"loss", "learning rate", "step time (s)", "tokens/s", "NVMe GB/s",
            "resident memory (MiB)", "gradient norm", "store bytes used (MiB)"} <= set(labels)
    tiers = labels["store bytes used (MiB)"]
    assert tiers.get_ylim()[0] == 0 and {"host budget", "nvme budget"} <= {
        line.get_label() for line in tiers.get_lines()}
    assert list(labels["loss"].get_lines()[0].get_xdata()) == [1, 2, 3, 4]
    assert all(float(t).is_integer() for t in labels["loss"].get_xticks())
    trace = json.loads((out / "trace.json").read_text())
    named = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e.get("name") == "process_name"}
    assert named == {1: "store moves", 2: "engine"}


def test_tokenizing_loading_and_exporting_show_progress(tmp_path, capsys, tiny_hf_model,
                                                        monkeypatch):
    from infinity.train import bars

    monkeypatch.setattr(bars, "DELAY_S", 0)  # as if each part had lasted past the delay
    data = tmp_path / "d.txt"
    data.write_text("some text to tokenize. " * 100)
    code, _, err = run_main(capsys, "--model", tiny_hf_model, "--data", data, "--steps", "1",
                            *SMALL, "--nvme-path", tmp_path / "nvme", "--output", tmp_path / "run")
    assert code == 0, err
    assert "tokenizing" in err and "loading" in err and "exporting" in err


def test_optimizer_state_flags_train_and_checkpoint_the_compressed_state(tmp_path, capsys):
    from infinity.checkpoint import CheckpointReader

    out = tmp_path / "run"
    code, _, err = run_main(capsys, "--steps", "2", *SMALL, "--bf16", "--optimizer-state", "int8",
                            "--no-master", "--save-every", "2", "--output", out)
    assert code == 0, err
    assert all(math.isfinite(r["loss"]) for r in metrics(out))
    reader = CheckpointReader(out / "checkpoints")
    assert reader.metadata["config"]["infinity"]["optimizer_state"] == {"moments": "int8",
                                                                        "master": "none"}
    code, _, err = run_main(capsys, "--steps", "1", *SMALL, "--fp32", "--no-master")
    assert code == 2 and "--no-master: this run trains in fp32" in err, err
