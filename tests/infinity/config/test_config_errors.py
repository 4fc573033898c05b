"""A corpus of wrong configs: each fails at load with one exception naming the culprit key."""

import json
import math
import os
import textwrap

import pytest

from infinity.config import load_config
from infinity.errors import ConfigError, ConfigPathError

S3 = {"stage": 3}

# (id, config, the key path the message must name, another fragment it must contain)
CORPUS = [
    ("nested typo", {"zero_optimization": {**S3, "offload_param": {"device": "cpu",
                                                                   "nvme_pth": "/x"}}},
     "zero_optimization.offload_param.nvme_pth", "'zero_optimization.offload_param.nvme_path'"),
    ("top-level typo", {"train_batch_szie": 8}, "train_batch_szie", "'train_batch_size'"),
    ("zero typo", {"zero_optimization": {"stage3_prefetch_bucket": 1}},
     "zero_optimization.stage3_prefetch_bucket", "'zero_optimization.stage3_prefetch_bucket_size'"),
    ("unknown key without a close match", {"zero_optimization": {"qqq": 1}},
     "zero_optimization.qqq", "valid keys here"),
    ("stage out of range", {"zero_optimization": {"stage": 4}}, "zero_optimization.stage",
     "one of 0, 1, 2, 3"),
    ("stage as a string", {"zero_optimization": {"stage": "3"}}, "zero_optimization.stage",
     "one of"),
    ("stage auto", {"zero_optimization": {"stage": "auto"}}, "zero_optimization.stage",
     "not allowed"),
    ("nvme without nvme_path", {"zero_optimization": {**S3, "offload_param": {"device": "nvme"}}},
     "zero_optimization.offload_param.nvme_path", "required"),
    ("optimizer nvme without nvme_path",
     {"zero_optimization": {**S3, "offload_optimizer": {"device": "nvme", "nvme_path": ""}}},
     "zero_optimization.offload_optimizer.nvme_path", "required"),
    ("unknown device", {"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     "zero_optimization.offload_optimizer.device", "'nvme'"),
    ("fp16 and bf16", {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled",
     "bf16"),
    ("param offload below stage 3",
     {"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}},
     "zero_optimization.offload_param.device", "stage 3"),
    ("partial offload below stage 3",
     {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     "zero_optimization.offload_optimizer.ratio", "stage 3"),
    ("batch triple disagrees", {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3,
                                "gradient_accumulation_steps": 2},
     "train_batch_size", "3 * 2 * 1 = 6"),
    ("batch pair does not divide", {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3},
     "train_batch_size", "3 * 3 * 1 = 9"),
    ("batch size zero", {"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu",
     "> 0"),
    ("bool for an int", {"train_batch_size": True}, "train_batch_size", "whole number"),
    ("fractional count", {"zero_optimization": {"sub_group_size": 1.5}},
     "zero_optimization.sub_group_size", "whole number"),
    ("empty sub-groups", {"zero_optimization": {"sub_group_size": 0}},
     "zero_optimization.sub_group_size", ">= 1"),
    ("no parameter buffers",
     {"zero_optimization": {**S3, "offload_param": {"device": "cpu", "buffer_count": 0}}},
     "zero_optimization.offload_param.buffer_count", ">= 1"),
    ("empty parameter buffers", {"zero_optimization": {**S3, "offload_param": {"buffer_size": 0}}},
     "zero_optimization.offload_param.buffer_size", ">= 1"),
    ("no optimizer buffers", {"zero_optimization": {"offload_optimizer": {"buffer_count": 0}}},
     "zero_optimization.offload_optimizer.buffer_count", ">= 1"),
    ("warmup max below min", {"scheduler": {"type": "WarmupLR", "params": {
        "warmup_min_lr": 0.01, "warmup_max_lr": 0.001}}},
     "scheduler.params.warmup_max_lr", "warmup_min_lr"),
    ("decay ends before warmup", {"scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 10, "warmup_num_steps": 100}}},
     "scheduler.params.total_num_steps", "warmup_num_steps"),
    ("cosine ratio above 1", {"scheduler": {"type": "WarmupCosineLR", "params": {
        "total_num_steps": 100, "warmup_num_steps": 10, "cos_min_ratio": 2}}},
     "scheduler.params.cos_min_ratio", "[0, 1]"),
    ("unknown warmup type", {"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "exp"}}},
     "scheduler.params.warmup_type", "'linear'"),
    ("scheduler type in the wrong case", {"scheduler": {"type": "warmuplr"}}, "scheduler.type",
     "WarmupLR"),
    ("scheduler DeepSpeed has but we do not", {"scheduler": {"type": "OneCycle"}},
     "scheduler.type", "not implemented"),
    ("param of another schedule", {"scheduler": {"type": "WarmupLR", "params": {
        "total_num_steps": 10}}}, "scheduler.params.total_num_steps", "unknown config key"),
    ("optimizer DeepSpeed has but we do not", {"optimizer": {"type": "Lamb"}}, "optimizer.type",
     "does not implement"),
    ("optimizer without type", {"optimizer": {"params": {"lr": 1e-3}}}, "optimizer.type",
     "missing"),
    ("one beta", {"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}},
     "optimizer.params.betas", "two numbers"),
    ("beta of 1", {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}},
     "optimizer.params.betas", "[0, 1)"),
    ("negative lr", {"optimizer": {"type": "Adam", "params": {"lr": -1}}}, "optimizer.params.lr",
     ">= 0"),
    ("amsgrad", {"optimizer": {"type": "Adam", "params": {"amsgrad": True}}},
     "optimizer.params.amsgrad", "AMSGrad"),
    ("misspelled optimizer param", {"optimizer": {"type": "Adam", "params": {"weight_decai": 0}}},
     "optimizer.params.weight_decai", "'optimizer.params.weight_decay'"),
    ("GDS", {"aio": {"use_gds": True}}, "aio.use_gds", "GDS"),
    ("unaligned block size", {"aio": {"block_size": 1000}}, "aio.block_size", "4096"),
    ("queue depth zero", {"aio": {"queue_depth": 0}}, "aio.queue_depth", "1..4096"),
    ("alias and its key", {"aio": {"thread_count": 2, "intra_op_parallelism": 4}},
     "aio.intra_op_parallelism is given twice, as aio.", "aio.thread_count"),
    ("aio in two places", {"aio": {}, "zero_optimization": {"aio": {}}},
     "zero_optimization.aio", "keep one"),
    ("nested aio typo", {"zero_optimization": {"aio": {"queue_dept": 4}}},
     "zero_optimization.aio.queue_dept", "'zero_optimization.aio.queue_depth'"),
    ("bf16 twice", {"bf16": {}, "bfloat16": {}}, "bfloat16", "keep one"),
    ("negative loss scale", {"fp16": {"loss_scale": -1}}, "fp16.loss_scale", ">= 0"),
    ("nan loss scale", {"fp16": {"loss_scale": math.nan}}, "fp16.loss_scale", "finite"),
    ("hysteresis zero", {"fp16": {"hysteresis": 0}}, "fp16.hysteresis", ">= 1"),
    ("section not an object", {"fp16": True}, "fp16", "JSON object"),
    ("section as auto", {"zero_optimization": {"offload_param": "auto"}},
     "zero_optimization.offload_param", "not allowed"),
    ("apex amp", {"amp": {"enabled": True}}, "amp.enabled", "apex"),
    ("negative clipping", {"gradient_clipping": -1.0}, "gradient_clipping", ">= 0"),
    ("steps_per_print zero", {"steps_per_print": 0}, "steps_per_print", ">= 1"),
    ("budget not a size", {"infinity": {"host_memory_budget": "8 gigs"}},
     "infinity.host_memory_budget", "8GB"),
    ("budget above the machine", {"infinity": {"host_memory_budget": "1000TB"}},
     "infinity.host_memory_budget", "this machine's memory"),
    ("budget zero", {"infinity": {"host_memory_budget": 0}}, "infinity.host_memory_budget",
     "> 0"),
    ("unknown compute dtype", {"infinity": {"compute_dtype": "fp8"}}, "infinity.compute_dtype",
     "'bf16'"),
    ("compute narrower than params", {"bf16": {"enabled": True},
                                      "infinity": {"compute_dtype": "fp16"}},
     "infinity.compute_dtype", "bf16"),
    ("unknown speculate", {"infinity": {"speculate": "never"}}, "infinity.speculate",
     "'auto', 'always'"),
    ("negative keep free", {"infinity": {"nvme_keep_free": -1}}, "infinity.nvme_keep_free",
     ">= 0"),
    ("keep free not a size", {"infinity": {"nvme_keep_free": "lots"}}, "infinity.nvme_keep_free",
     "GB"),
    ("typo in our own section", {"infinity": {"trace_prefetc": True}}, "infinity.trace_prefetc",
     "'infinity.trace_prefetch'"),
    ("typo in an ignored section", {"activation_checkpointing": {"cpu_checkpoint": True}},
     "activation_checkpointing.cpu_checkpoint", "'activation_checkpointing.cpu_checkpointing'"),
    ("bool as a string", {"wall_clock_breakdown": "false"}, "wall_clock_breakdown",
     "JSON boolean"),
]


@pytest.mark.parametrize("raw, key, fragment", [c[1:] for c in CORPUS], ids=[c[0] for c in CORPUS])
def test_bad_config_names_the_culprit(raw, key, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(raw)
    message = str(info.value)
    assert key in message and fragment in message, message
    assert not isinstance(info.value, OSError)
    # One clear exception: no chained cause shown under it.
    assert info.value.__cause__ is None
    assert info.value.__context__ is None or info.value.__suppress_context__


def test_the_corpus_is_large():
    assert len(CORPUS) >= 20


def test_world_size_must_be_positive():
    with pytest.raises(ConfigError, match="world_size"):
        load_config({}, world_size=0)


def test_config_that_is_not_a_dict_or_path():
    with pytest.raises(ConfigError, match="pass a dict or the path"):
        load_config(42)
    with pytest.raises(ConfigError, match="config is a list"):
        load_config([])
    with pytest.raises(ConfigError, match="JSON object"):
        load_config({"zero_optimization": [1]})


def test_missing_config_file_is_an_oserror_naming_it(tmp_path):
    path = tmp_path / "nope.json"
    with pytest.raises(ConfigPathError) as info:
        load_config(path)
    assert isinstance(info.value, OSError) and info.value.filename == str(path)


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8,\n}\n')
    with pytest.raises(ConfigError, match=r"bad.json: not valid JSON at line 3"):
        load_config(path)


def test_decaying_schedule_needs_total_steps_when_built():
    from infinity.engine import build_lr_schedule
    config = load_config({"scheduler": {"type": "WarmupDecayLR",
                                        "params": {"total_num_steps": "auto"}}})
    with pytest.raises(ConfigError, match="scheduler.params.total_num_steps"):
        build_lr_schedule(config.scheduler, optimizer_lr=1e-3)
    assert build_lr_schedule(config.scheduler, optimizer_lr=1e-3,
                             total_num_steps=100).total_num_steps == 100


def test_lr_below_warmup_min_fails_when_the_schedule_is_built():
    from infinity.engine import build_lr_schedule
    config = load_config({"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.1}}})
    with pytest.raises(ConfigError, match="warmup_max_lr"):
        build_lr_schedule(config.scheduler, optimizer_lr=1e-3)


def _nvme(path: str, which: str = "offload_param") -> dict:
    return {"zero_optimization": {"stage": 3, which: {"device": "nvme", "nvme_path": path}}}


def test_nvme_path_that_is_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ConfigPathError) as info:
        load_config(_nvme(str(path), "offload_optimizer"))
    assert "zero_optimization.offload_optimizer.nvme_path" in str(info.value)
    assert info.value.filename == str(path) and "not a directory" in str(info.value)


def test_nvme_path_under_a_file(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ConfigPathError, match="zero_optimization.offload_param.nvme_path"):
        load_config(_nvme(str(path / "sub")))


@pytest.mark.parametrize("sub", ["", "new/dir"], ids=["existing", "to-create"])
def test_unwritable_nvme_path_as_an_unprivileged_user(read_only_dir, run_unprivileged, sub):
    """A directory nobody may write into (or create under): OSError naming key and path."""
    target = os.path.join(read_only_dir, sub) if sub else read_only_dir
    raw = json.dumps(_nvme(target))
    out = run_unprivileged(textwrap.dedent(f"""
        import json
        from infinity.config import load_config
        from infinity.errors import ConfigPathError
        try:
            load_config(json.loads({raw!r}))
        except ConfigPathError as e:
            print("ERR", e.errno, isinstance(e, OSError), e)
            sys.exit(0)
        sys.exit(1)
    """))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ERR 13 True" in out.stdout, out.stdout
    assert "zero_optimization.offload_param.nvme_path" in out.stdout and target in out.stdout
    assert "Traceback" not in out.stderr
