"""infinity.hf.Trainer against transformers.Trainer on the same small model and data (fp32,
dropout 0, max_grad_norm 1.0, warmup + linear decay, accumulation 2; parameters and optimizer
state on NVMe): every logged loss and grad norm within 1e-5 relative over 10 steps and the
same learning rates; evaluate() the same eval_loss; save_model() loads with from_pretrained and
gives the same logits; resuming from checkpoint-5 ends bit-identical. And the config's "auto"
filled as transformers fills it, and infinity.hf.from_pretrained."""

import sys
from pathlib import Path

import pytest
import torch
import transformers

import infinity.hf
from infinity.errors import CheckpointError

sys.path.insert(0, str(Path(__file__).parent))
from hf_case import (  # noqa: E402
    SAVE_AT,
    STEPS,
    Tokens,
    arguments,
    base_model,
    copy_of,
    dirs,
    ds_config,
    train_logs,
)


class _Seen(transformers.TrainerCallback):
    """What the Trainer tells its callbacks: step ends, logs, saves."""

    def __init__(self) -> None:
        self.steps, self.logs, self.saves = [], [], []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))

    def on_save(self, args, state, control, **kwargs):
        self.saves.append(state.global_step)


def _close(a: float, b: float, rtol: float = 1e-5) -> bool:
    return abs(a - b) <= rtol * abs(b)


def test_the_trainer_on_infinity_logs_evaluates_saves_and_resumes_as_the_trainer(tmp_path):
    base = base_model()
    train, evaluation = Tokens(2 * 2 * STEPS, 1), Tokens(8, 2)
    plain_dir, ours_dir, again_dir, nvme, model_dir = dirs(
        str(tmp_path), "plain", "ours", "again", "nvme", "model"
    )
    plain = transformers.Trainer(
        model=copy_of(base),
        args=arguments(plain_dir, save_strategy="no"),
        train_dataset=train,
        eval_dataset=evaluation,
    )
    plain.train()
    seen = _Seen()
    ours = infinity.hf.Trainer(
        model=copy_of(base),
        args=arguments(ours_dir, save_steps=SAVE_AT),
        train_dataset=train,
        eval_dataset=evaluation,
        config=ds_config(nvme),
        callbacks=[seen],
    )
    ours.train()
    assert seen.steps == list(range(1, STEPS + 1)) and seen.saves == [SAVE_AT, STEPS]
    assert [log["loss"] for log in seen.logs if "loss" in log] == [
        e["loss"] for e in train_logs(ours)
    ]

    expected, got = train_logs(plain), train_logs(ours)
    assert [e["step"] for e in got] == list(range(1, STEPS + 1)) == [e["step"] for e in expected]
    for e, g in zip(expected, got):
        assert _close(g["loss"], e["loss"]) and _close(g["grad_norm"], float(e["grad_norm"])), (
            e,
            g,
        )
        assert g["learning_rate"] == pytest.approx(e["learning_rate"], rel=1e-12)
    assert _close(ours.evaluate()["eval_loss"], plain.evaluate()["eval_loss"])
    torch.testing.assert_close(
        ours.predict(evaluation).predictions,
        plain.predict(evaluation).predictions,
        rtol=1e-4,
        atol=1e-5,
    )

    ours.save_model(model_dir)
    loaded = transformers.LlamaForCausalLM.from_pretrained(model_dir)
    x = torch.randint(0, 48, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, ours.model(x).logits)
        torch.testing.assert_close(loaded(x).logits, plain.model(x).logits, rtol=1e-4, atol=1e-5)
    assert (Path(model_dir) / "config.json").is_file()

    checkpoint = Path(ours_dir) / f"checkpoint-{SAVE_AT}"
    assert (checkpoint / f"global_step{SAVE_AT}").is_dir() and (
        checkpoint / "trainer_state.json"
    ).is_file()
    again = infinity.hf.Trainer(
        model=base_model(),
        args=arguments(again_dir, save_strategy="no"),
        train_dataset=train,
        eval_dataset=evaluation,
        config=ds_config(nvme),
    )
    again.train(resume_from_checkpoint=str(checkpoint))
    resumed = train_logs(again)  # steps 1-5 come from checkpoint-5's trainer state
    assert [e["step"] for e in resumed] == list(range(1, STEPS + 1))
    assert resumed[SAVE_AT:] == got[SAVE_AT:]  # the same floats, bit for bit
    final = dict(again.engine.named_parameters())
    assert all(torch.equal(final[n], v) for n, v in ours.engine.named_parameters())


def test_auto_is_filled_from_the_training_arguments_as_transformers_fills_it(tmp_path):
    args = arguments(str(tmp_path), adam_beta1=0.8, warmup_steps=0)
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "bf16": {"enabled": "auto"},
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": "auto",
            "reduce_bucket_size": "auto",
        },
    }
    filled = infinity.hf.fill_from_training_args(config, args, base_model(), 40)
    assert config["gradient_clipping"] == "auto"  # the caller's dict is left alone
    assert filled["train_micro_batch_size_per_gpu"] == 2 and filled["train_batch_size"] == 4
    assert filled["gradient_clipping"] == 1.0 and filled["bf16"] == {"enabled": False}
    assert filled["optimizer"]["params"] == {
        "lr": 3e-3,
        "betas": [0.8, 0.999],
        "eps": 1e-8,
        "weight_decay": 0.1,
    }
    assert filled["scheduler"]["params"] == {
        "warmup_min_lr": 0,
        "warmup_max_lr": 3e-3,
        "warmup_num_steps": 1,
        "total_num_steps": 40,
    }
    assert filled["zero_optimization"]["stage3_param_persistence_threshold"] == 160
    assert filled["zero_optimization"]["reduce_bucket_size"] == 256
    assert "gradient_accumulation_steps" not in filled  # absent stays absent
    with pytest.raises(
        ValueError, match=r"gradient_clipping=0.5 vs TrainingArguments max_grad_norm=1.0"
    ):
        infinity.hf.fill_from_training_args(
            {**config, "gradient_clipping": 0.5}, args, base_model(), 40
        )
    with pytest.raises(TypeError, match="config="):
        infinity.hf.Trainer(model=base_model(), args=args)


def test_the_config_optimizer_and_scheduler_replace_the_trainers(tmp_path):
    """A config naming its optimizer and scheduler trains with them, "auto" from the arguments
    (and with gradient checkpointing):
    WarmupLR over the Trainer's 3 warmup steps up to its learning rate (docs/engine.md: update k
    runs at lr_at(k - 1), linear warmup lr_at(s) = max * s / 3)."""
    config = {
        **ds_config(str(tmp_path)),
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "warmup_type": "linear",
            },
        },
    }
    args = arguments(
        str(tmp_path / "out"), save_strategy="no", max_steps=4, activation_checkpointing=True
    )
    trainer = infinity.hf.Trainer(
        model=base_model(), args=args, train_dataset=Tokens(16, 1), config=config
    )
    trainer.train()
    assert trainer.model.is_activation_checkpointing  # recomputed under the engine's hooks
    assert [e["learning_rate"] for e in train_logs(trainer)] == pytest.approx(
        [0.0, 0.0, 1e-3, 2e-3]
    )


def test_from_pretrained_reads_a_folder_or_the_hub_cache_offline(tmp_path, monkeypatch):
    """A model streamed into the store goes straight into the Trainer, which adopts the store:
    trained at learning rate 0, it evaluates as the folder's model does."""
    folder = tmp_path / "llama"
    base_model().save_pretrained(folder)
    config = ds_config(str(tmp_path))
    model = infinity.hf.from_pretrained(folder, config)
    assert all(p.numel() == 0 for p in model.parameters())  # the values are in the store
    args = arguments(str(tmp_path / "out"), save_strategy="no", max_steps=1, learning_rate=0.0)
    trainer = infinity.hf.Trainer(
        model=model, args=args, train_dataset=Tokens(4, 1), eval_dataset=Tokens(4, 2), config=config
    )
    with pytest.raises(RuntimeError, match="before train"):
        trainer.evaluate()
    trainer.train()
    plain = transformers.Trainer(model=base_model(), args=args, eval_dataset=Tokens(4, 2))
    assert _close(trainer.evaluate()["eval_loss"], plain.evaluate()["eval_loss"])

    cache = tmp_path / "cache"
    snapshot = cache / "models--someone--tiny" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    (cache / "models--someone--tiny" / "refs").mkdir()
    (cache / "models--someone--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    cached = infinity.hf.from_pretrained("someone/tiny", config)
    assert [n for n, _ in cached.named_parameters()] == [n for n, _ in model.named_parameters()]
    with pytest.raises(
        CheckpointError, match="neither a local folder nor in the Hugging Face cache"
    ) as error:
        infinity.hf.from_pretrained("someone/absent", config)
    assert "\n" not in str(error.value)
