"""The ZeRO-Infinity example configs of DeepSpeed's and Hugging Face's docs load unchanged.

The JSON files in examples/ reproduce the documented key sets and values; the only edit at test
time is the placeholder NVME_PATH, which becomes a directory under tmp_path (the docs' own
`/local_nvme` does not exist here).
"""

import json
import pathlib
import types

import pytest
import torch
import transformers

from infinity.config import load_config
from infinity.engine import build_lr_schedule

EXAMPLES = pathlib.Path(__file__).parent / "examples"


def _load(name: str, tmp_path, **kwargs):
    text = (EXAMPLES / name).read_text().replace("NVME_PATH", str(tmp_path / "nvme"))
    path = tmp_path / name
    path.write_text(text)
    return load_config(path, **kwargs)


def _model(hidden_size: int) -> torch.nn.Module:
    model = torch.nn.Linear(2, 2)
    model.config = types.SimpleNamespace(hidden_size=hidden_size)
    return model


@pytest.mark.parametrize("name", sorted(p.name for p in EXAMPLES.glob("*.json")))
def test_every_example_loads(name, tmp_path):
    config = _load(name, tmp_path)
    assert config.zero_optimization.stage in (0, 2, 3)
    json.loads((EXAMPLES / name).read_text())  # the data are plain JSON


def test_there_are_examples_from_both_docs():
    names = [p.name for p in EXAMPLES.glob("*.json")]
    assert sum(n.startswith("deepspeed_") for n in names) >= 3
    assert sum(n.startswith("hf_") for n in names) >= 3


def test_deepspeed_zero_infinity_cpu(tmp_path):
    zero = _load("deepspeed_zero_infinity_cpu.json", tmp_path).zero_optimization
    assert zero.stage == 3
    assert (zero.offload_param.device, zero.offload_optimizer.device) == ("cpu", "cpu")
    assert zero.stage3_prefetch_bucket_size == 10**7
    assert zero.stage3_param_persistence_threshold == 10**5


def test_deepspeed_zero_infinity_nvme(tmp_path):
    config = _load("deepspeed_zero_infinity_nvme.json", tmp_path)
    zero = config.zero_optimization
    nvme = str(tmp_path / "nvme")
    assert zero.offload_param.nvme_path == zero.offload_optimizer.nvme_path == nvme
    assert (zero.offload_param.device, zero.offload_optimizer.device) == ("nvme", "nvme")
    assert config.aio.handle_options() == {"block_size": 1 << 20, "queue_depth": 8, "threads": 1}
    assert (config.train_batch_size, config.gradient_accumulation_steps) == (8, 8)
    ignored = " ".join(config.not_honoured)
    assert "offload_param.buffer_size" in ignored and "aio.single_submit" in ignored


def test_deepspeed_adam_warmup_fp16(tmp_path):
    config = _load("deepspeed_adam_warmup_fp16.json", tmp_path)
    assert config.precision == "fp16" and config.fp16.dynamic
    assert config.fp16.initial_scale == 65536.0
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu) == (32, 8)
    params = config.optimizer.params
    assert (params.lr, params.betas, params.weight_decay) == (1e-3, (0.8, 0.999), 3e-7)
    schedule = build_lr_schedule(config.scheduler, optimizer_lr=params.lr)
    assert schedule.lr_at(999) == pytest.approx(1e-3) and schedule.lr_at(-1) == 0.0
    ignored = " ".join(config.not_honoured)
    for section in ("activation_checkpointing", "flops_profiler", "tensorboard", "csv_monitor",
                    "wandb"):
        assert section in ignored


def test_hf_zero3_cpu_auto_with_a_model(tmp_path):
    config = _load("hf_zero3_offload_cpu_auto.json", tmp_path, model=_model(1024))
    zero = config.zero_optimization
    assert zero.reduce_bucket_size == 1024 * 1024
    assert zero.stage3_prefetch_bucket_size == 943718  # int(0.9 * 1024**2)
    assert zero.stage3_param_persistence_threshold == 10240
    assert zero.stage3_gather_16bit_weights_on_model_save
    assert config.optimizer.params.lr == 5e-5 and config.gradient_clipping == 1.0
    assert config.precision == "fp32" and config.batch_pending
    assert config.gradient_accumulation_steps == 1
    schedule = build_lr_schedule(config.scheduler, optimizer_lr=config.optimizer.params.lr)
    assert schedule.lr_at(0) == 0.0 and schedule.lr_at(2) == pytest.approx(5e-5)


def test_hf_zero3_nvme_auto_takes_aio_from_zero_optimization(tmp_path):
    config = _load("hf_zero3_offload_nvme_auto.json", tmp_path, model=_model(512))
    assert config.aio.handle_options() == {"block_size": 262144, "queue_depth": 32, "threads": 1}
    assert config.zero_optimization.offload_param.device == "nvme"
    assert config.zero_optimization.reduce_bucket_size == 512 * 512


def test_hf_zero2_decay_auto_needs_total_steps_at_build(tmp_path):
    config = _load("hf_zero2_decay_auto.json", tmp_path)
    assert config.zero_optimization.stage == 2
    assert config.zero_optimization.offload_optimizer.device == "cpu"
    assert config.scheduler.type == "WarmupDecayLR"
    assert config.scheduler.params.total_num_steps is None and not config.amp.enabled
    schedule = build_lr_schedule(config.scheduler, optimizer_lr=config.optimizer.params.lr,
                                 total_num_steps=100)
    assert schedule.lr_at(100) == 0.0 and schedule.lr_at(50) == pytest.approx(5e-5 * 50 / 98)


def test_hf_zero3_inference_nvme(tmp_path):
    config = _load("hf_zero3_inference_nvme.json", tmp_path)
    assert config.precision == "bf16"
    assert config.zero_optimization.offload_param.buffer_size == 10**9
    assert config.zero_optimization.stage3_max_live_parameters == 10**9  # "auto"


def test_hf_auto_from_a_transformers_model(tmp_path):
    """A real (tiny, randomly initialised) transformers model: hidden_size via its config."""
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=16))
    config = _load("hf_zero3_offload_cpu_auto.json", tmp_path, model=model)
    assert config.zero_optimization.reduce_bucket_size == 32 * 32
    assert config.zero_optimization.stage3_param_persistence_threshold == 320
