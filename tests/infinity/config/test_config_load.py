"""load_config: DeepSpeed's meaning and defaults, "auto" filling, batch sizes, what is logged."""

import dataclasses
import json
import logging
import types

import pytest
import torch

import aio
from infinity.config import Config, load_config, parse_bytes
from infinity.errors import ConfigError


def _model(hidden_size: int) -> torch.nn.Module:
    model = torch.nn.Linear(2, 2)
    model.config = types.SimpleNamespace(hidden_size=hidden_size)
    return model


def test_empty_config_has_deepspeed_defaults():
    config = load_config({})
    zero = config.zero_optimization
    assert (zero.stage, zero.offload_param.device,
            zero.offload_optimizer.device) == (0, "none", "none")
    assert zero.stage3_prefetch_bucket_size == 5 * 10**7
    assert zero.stage3_param_persistence_threshold == 10**5
    assert zero.stage3_max_live_parameters == zero.stage3_max_reuse_distance == 10**9
    assert zero.sub_group_size == 10**9 and zero.reduce_bucket_size == 5 * 10**8
    assert zero.offload_param.pin_memory and zero.offload_param.buffer_count == 5
    assert zero.offload_optimizer.buffer_count == 4
    assert (config.aio.block_size, config.aio.queue_depth, config.aio.intra_op_parallelism) == \
        (1 << 20, 8, 1)
    assert config.aio.overlap_events and not config.aio.single_submit
    fp16 = config.fp16
    assert not fp16.enabled and fp16.dynamic and fp16.initial_scale == 2.0**16
    assert (fp16.loss_scale_window, fp16.hysteresis, fp16.min_loss_scale) == (1000, 2, 1.0)
    assert config.precision == "fp32"
    assert config.gradient_clipping == 0.0 and config.steps_per_print == 10
    assert config.optimizer is None and config.scheduler is None
    assert config.infinity.trace_prefetch and config.infinity.compute_dtype == "auto"
    assert not config.infinity.checksum and config.infinity.aio_backend == "auto"


def test_whole_floats_are_ints_where_an_int_is_expected():
    config = load_config({"zero_optimization": {"stage": 3, "sub_group_size": 1e9,
                                                "stage3_prefetch_bucket_size": 5e8},
                          "train_micro_batch_size_per_gpu": 4.0})
    zero = config.zero_optimization
    assert zero.sub_group_size == 10**9 and isinstance(zero.sub_group_size, int)
    assert zero.stage3_prefetch_bucket_size == 5 * 10**8
    assert config.train_micro_batch_size_per_gpu == 4
    assert isinstance(config.train_micro_batch_size_per_gpu, int)


@pytest.mark.parametrize("text, nbytes", [
    ("8GB", 8 * 10**9), ("512MiB", 512 << 20), ("4G", 4 << 30), ("1.5GiB", 3 << 29),
    ("4096", 4096), ("100 KB", 100_000), ("2TiB", 2 << 40), ("64k", 64 << 10)])
def test_byte_sizes_with_units(text, nbytes):
    assert parse_bytes(text) == nbytes


def test_host_memory_budget_accepts_bytes_and_unit_strings():
    assert load_config({"infinity": {"host_memory_budget": "512MiB"}}).infinity.host_memory_budget \
        == 512 << 20
    assert load_config({"infinity": {"host_memory_budget": 1e9}}).infinity.host_memory_budget \
        == 10**9


def test_host_memory_budget_auto_and_absent_follow_the_machine(monkeypatch):
    import infinity.config._auto as auto
    from infinity.config._machine import available_memory_bytes, total_memory_bytes
    assert 0 < available_memory_bytes() <= total_memory_bytes()
    monkeypatch.setattr(auto, "available_memory_bytes", lambda: 10 * 2**30)
    for infinity in ({}, {"host_memory_budget": "auto"}, {"host_memory_budget": None}):
        config = load_config({"infinity": infinity})
        assert config.infinity.host_memory_budget == 8 * 2**30
    assert "infinity.host_memory_budget=8589934592 (80% of available memory)" in \
        config.auto_filled


def test_aio_maps_onto_handle_options_and_thread_count_alias():
    config = load_config({"aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 2}})
    options = config.aio.handle_options()
    assert options == {"block_size": 262144, "queue_depth": 32, "threads": 2}
    with aio.Handle(**options, backend="threads") as handle:
        assert (handle.block_size, handle.queue_depth, handle.threads) == (262144, 32, 2)


def test_bfloat16_alias_and_precision():
    config = load_config({"bfloat16": {"enabled": True}})
    assert config.bf16.enabled and config.precision == "bf16"
    assert load_config({"fp16": {"enabled": True}}).precision == "fp16"


def test_optimizer_type_any_case_and_deepspeed_adam_w_mode_rule():
    adam = load_config({"optimizer": {"type": "adam", "params": {"weight_decay": 0.1}}}).optimizer
    assert adam.type == "Adam" and adam.decoupled_weight_decay  # DeepSpeed's adam_w_mode default
    l2 = load_config({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).optimizer
    assert not l2.decoupled_weight_decay
    adamw = load_config({"optimizer": {"type": "ADAMW", "params": {"adam_w_mode": False}}})
    assert adamw.optimizer.type == "AdamW" and adamw.optimizer.decoupled_weight_decay
    defaults = load_config({"optimizer": {"type": "AdamW"}}).optimizer.params
    assert (defaults.lr, defaults.betas, defaults.eps, defaults.weight_decay) == \
        (1e-3, (0.9, 0.999), 1e-8, 0.0)


def test_auto_takes_trainer_defaults_and_model_hidden_size(caplog):
    raw = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto",
                                                     "eps": "auto", "weight_decay": "auto"}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                        "warmup_max_lr": "auto",
                                                        "warmup_num_steps": "auto"}},
           "gradient_clipping": "auto", "fp16": {"enabled": "auto"},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                 "stage3_prefetch_bucket_size": "auto",
                                 "stage3_param_persistence_threshold": "auto",
                                 "stage3_max_live_parameters": "auto"}}
    with caplog.at_level(logging.INFO, logger="infinity.config"):
        config = load_config(raw, model=_model(64))
    params = config.optimizer.params
    assert (params.lr, params.betas, params.eps, params.weight_decay) == \
        (5e-5, (0.9, 0.999), 1e-8, 0.0)
    assert config.gradient_clipping == 1.0 and not config.fp16.enabled
    sched = config.scheduler.params
    assert (sched.warmup_min_lr, sched.warmup_max_lr, sched.warmup_num_steps) == (0.0, 5e-5, 0)
    zero = config.zero_optimization
    assert zero.reduce_bucket_size == 64 * 64
    assert zero.stage3_prefetch_bucket_size == int(0.9 * 64 * 64)
    assert zero.stage3_param_persistence_threshold == 640
    assert zero.stage3_max_live_parameters == 10**9  # no rule: DeepSpeed's default
    filled = [r.getMessage() for r in caplog.records if "filled" in r.getMessage()]
    assert len(filled) == 1, "one log line lists everything filled"
    for key in ("optimizer.params.lr=5e-05", "gradient_clipping=1.0",
                "zero_optimization.reduce_bucket_size=4096", "stage3_max_live_parameters",
                "train_micro_batch_size_per_gpu=None (from the first batch)"):
        assert key in filled[0]
    assert any(key.startswith("zero_optimization.reduce_bucket_size=")
               for key in config.auto_filled)


def test_auto_bucket_sizes_without_a_model_get_deepspeed_defaults():
    zero = load_config({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}})
    assert zero.zero_optimization.reduce_bucket_size == 5 * 10**8


def test_warmup_max_lr_auto_follows_the_optimizer_lr():
    config = load_config({"optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
                          "scheduler": {"type": "WarmupLR",
                                        "params": {"warmup_max_lr": "auto"}}})
    assert config.scheduler.params.warmup_max_lr == 3e-4


@pytest.mark.parametrize("given, expected", [
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4}, (32, 4, 8)),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 2}, (32, 16, 2)),
    ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, (8, 4, 2)),
    ({"train_batch_size": 12}, (12, 12, 1)),
    ({"train_micro_batch_size_per_gpu": 3}, (3, 3, 1)),
    ({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
      "gradient_accumulation_steps": 4}, (8, 2, 4)),
])
def test_any_two_batch_sizes_determine_the_third(given, expected):
    config = load_config(given)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps) == expected
    assert not config.batch_pending


def test_batch_sizes_with_world_size():
    config = load_config({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4},
                         world_size=2)
    assert config.gradient_accumulation_steps == 4 and config.world_size == 2


def test_batch_size_waits_for_the_first_batch():
    config = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
                          "gradient_accumulation_steps": 4})
    assert config.batch_pending
    assert config.train_batch_size is None and config.train_micro_batch_size_per_gpu is None
    resolved = config.with_micro_batch(3)
    assert (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu) == (12, 3)
    assert not resolved.batch_pending and resolved.with_micro_batch(5) is resolved
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu"):
        config.with_micro_batch(0)


def test_sections_are_frozen_and_keyword_only():
    config = load_config({})
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.zero_optimization.stage = 3
    with pytest.raises(TypeError):
        Config(1)


def test_every_field_has_a_docstring():
    """Each field of each section carries a string docstring under it (unit, default)."""
    import ast
    import pathlib

    import infinity.config as package
    from infinity.config._section import Section

    def subclasses(cls):
        for sub in cls.__subclasses__():
            yield sub.__name__
            yield from subclasses(sub)

    sections = set(subclasses(Section))
    missing = []
    for path in pathlib.Path(package.__file__).parent.glob("_*.py"):
        tree = ast.parse(path.read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in sections):
            body = cls.body
            for i, node in enumerate(body):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                        and "ClassVar" not in ast.unparse(node.annotation):
                    doc = body[i + 1] if i + 1 < len(body) else None
                    if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)):
                        missing.append(f"{path.name}:{cls.name}.{node.target.id}")
    assert len(sections) > 15 and not missing, missing


def test_not_honoured_keys_are_logged_once(caplog):
    raw = {"zero_optimization": {"stage": 3, "overlap_comm": True, "allgather_bucket_size": 1e9,
                                 "offload_param": {"device": "cpu", "buffer_count": 5}},
           "tensorboard": {"enabled": True}, "communication_data_type": "fp32"}
    with caplog.at_level(logging.INFO, logger="infinity.config"):
        config = load_config(raw)
    lines = [r.getMessage() for r in caplog.records if "not honoured" in r.getMessage()]
    assert len(lines) == 1
    for key in ("zero_optimization.overlap_comm", "zero_optimization.allgather_bucket_size",
                "zero_optimization.offload_param.buffer_count", "tensorboard",
                "communication_data_type"):
        assert key in lines[0]
        assert any(entry.startswith(key + " (") for entry in config.not_honoured)


def test_config_file_path_is_read(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    assert load_config(path).train_micro_batch_size_per_gpu == 2
    assert load_config(str(path)).train_batch_size == 2


def test_the_callers_dict_is_not_modified():
    raw = {"zero_optimization": {"stage": 3, "aio": {"block_size": 262144}},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}
    before = json.dumps(raw, sort_keys=True)
    load_config(raw)
    assert json.dumps(raw, sort_keys=True) == before


def test_nvme_path_is_checked_and_created_nowhere(tmp_path):
    target = tmp_path / "not" / "yet"
    config = load_config({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(target)}}})
    assert config.zero_optimization.offload_param.nvme_path == str(target)
    assert not (tmp_path / "not").exists()
    existing = tmp_path / "nvme"
    existing.mkdir()
    load_config({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(existing)}}})
    assert list(existing.iterdir()) == [], "the write probe leaves nothing behind"


def test_docs_list_every_key_accepted_but_not_honoured():
    import pathlib

    import infinity.config as c
    from infinity.config._sections import _WarmupParams
    docs = (pathlib.Path(__file__).parents[3] / "docs" / "engine.md").read_text()
    places = {"": c.Config, "optimizer": c.OptimizerConfig, "zero_optimization": c.ZeroConfig,
              "zero_optimization.offload_param": c.OffloadParamConfig,
              "zero_optimization.offload_optimizer": c.OffloadOptimizerConfig,
              "optimizer.params": c.AdamParams, "scheduler.params": _WarmupParams,
              "fp16": c.FP16Config, "bf16": c.BF16Config, "aio": c.AioConfig,
              "activation_checkpointing": c.ActivationCheckpointingConfig}
    missing = [f"{path}.{key}".lstrip(".")
               for path, cls in places.items() for key in [*cls.NOT_HONOURED, *cls.OPAQUE]
               if f"`{path}.{key}`".replace("`.", "`") not in docs]
    missing += [name for name in ("flops_profiler", "tensorboard",
                                  "csv_monitor", "wandb") if f"`{name}` (keys checked)" not in docs]
    assert not missing, missing


def test_warmup_decay_default_top_is_deepspeeds_not_the_optimizers():
    from infinity.engine import build_lr_schedule
    config = load_config({"optimizer": {"type": "AdamW", "params": {"lr": 5e-4}},
                          "scheduler": {"type": "WarmupDecayLR",
                                        "params": {"total_num_steps": 100,
                                                   "warmup_num_steps": 10}}})
    assert config.scheduler.params.warmup_max_lr == 1e-3
    warmup_only = load_config({"scheduler": {"type": "WarmupLR"}}).scheduler
    assert warmup_only.params.warmup_max_lr is None  # the optimizer's lr, when built
    assert build_lr_schedule(warmup_only, optimizer_lr=5e-4).lr_at(5000) == 5e-4


def test_scheduler_without_params_gets_its_types_defaults():
    params = load_config({"scheduler": {"type": "WarmupCosineLR"}}).scheduler.params
    assert (params.warmup_min_ratio, params.cos_min_ratio, params.total_num_steps) == \
        (0.0, 1e-4, None)


def test_null_subsection_means_its_defaults():
    zero = load_config({"zero_optimization": {"stage": 3, "offload_param": None}})
    assert zero.zero_optimization.offload_param.device == "none"


def test_deprecated_cpu_offload_keys():
    zero = load_config({"zero_optimization": {
        "stage": 3, "cpu_offload": True, "cpu_offload_param": True,
        "cpu_offload_use_pin_memory": False}}).zero_optimization
    assert zero.offload_optimizer.device == zero.offload_param.device == "cpu"
    assert not zero.offload_optimizer.pin_memory and not zero.offload_param.pin_memory
    off = load_config({"zero_optimization": {"stage": 2, "cpu_offload": False}})
    assert off.zero_optimization.offload_optimizer.device == "none"
    with pytest.raises(ConfigError, match="zero_optimization.cpu_offload .*keep offload_optimizer"):
        load_config({"zero_optimization": {"cpu_offload": True,
                                           "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match="zero_optimization.cpu_offload_param = 'yes'"):
        load_config({"zero_optimization": {"cpu_offload_param": "yes"}})


def test_a_loaded_config_passes_through():
    config = load_config({"train_micro_batch_size_per_gpu": 2})
    assert load_config(config) is config


def test_a_cgroup_limit_caps_the_machine(tmp_path, monkeypatch):
    import infinity.config._machine as machine
    (tmp_path / "memory.max").write_text("1073741824\n")
    (tmp_path / "memory.current").write_text("805306368\n")
    monkeypatch.setattr(machine, "_CGROUP", tmp_path)
    assert machine.total_memory_bytes() == 1 << 30
    assert machine.available_memory_bytes() == 1 << 28
    (tmp_path / "memory.max").write_text("max\n")
    assert machine.total_memory_bytes() > 1 << 30  # no limit: the physical memory
    with pytest.raises(ConfigError, match="infinity.host_memory_budget"):
        monkeypatch.setattr(machine, "_CGROUP", tmp_path / "limited")
        (tmp_path / "limited").mkdir()
        (tmp_path / "limited" / "memory.max").write_text(str(1 << 30))
        load_config({"infinity": {"host_memory_budget": "2GiB"}})
