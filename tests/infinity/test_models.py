"""infinity.models.load: a save_pretrained directory streams into the store and behaves as the
original model (logits, training through initialize); dtype conversion; every broken directory
gives a CheckpointError naming file and tensor, before anything is placed."""

import copy
import json
import os
import time

import pytest
import safetensors.torch as safetensors_torch
import torch
import transformers

import infinity
from infinity import CheckpointError, ConfigError
from infinity.engine import Placed
from infinity.store import TensorStore, Tier

WINDOW = 1 << 20  # the smallest window: slices of 128 Ki elements (fp32 from fp32)


def tiny_llama(tie: bool = True, **overrides) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
    cfg = transformers.LlamaConfig(tie_word_embeddings=tie, **{**shape, **overrides})
    return transformers.LlamaForCausalLM(cfg).eval()


def config(tmp_path, *, param="nvme", bf16=False) -> dict:
    nvme = tmp_path / "swap"
    nvme.mkdir(exist_ok=True)
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "sub_group_size": 1024,
            "offload_param": {"device": param,
                              **({"nvme_path": str(nvme)} if param == "nvme" else {})},
            "offload_optimizer": {"device": "cpu"}}
    return {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": bf16},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
            "zero_optimization": zero, "infinity": {"host_memory_budget": "1GB"}}


def saved(tmp_path, model: torch.nn.Module, name: str = "ckpt", shard: str | None = "20KB") -> str:
    directory = tmp_path / name
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(directory, **kwargs)
    return str(directory)


def batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (2, 12), generator=g) for _ in range(n)]


@pytest.mark.parametrize("shard", ["20KB", None], ids=["sharded", "single-file"])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_logits_equal_the_original(tmp_path, shard, tie):
    original = tiny_llama(tie)
    directory = saved(tmp_path, original, shard=shard)
    names = os.listdir(directory)
    assert ("model.safetensors.index.json" in names) == (shard is not None)
    cfg = config(tmp_path)
    model = infinity.models.load(directory, cfg, window=WINDOW)
    # nothing but placeholders before initialize
    assert all(p.numel() == 0 for p in model.parameters())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    ids = batches(1)[0]
    with infinity.initialize(model, cfg) as engine, torch.no_grad():
        assert engine.plan.param_home == Tier.NVME
        assert torch.equal(engine(ids).logits, original(ids).logits)


def test_trains_as_the_original_through_initialize(tmp_path, train_lm):
    original = tiny_llama()
    directory = saved(tmp_path, original)
    cfg = config(tmp_path)
    losses = {}
    params = {}
    for label, model in (("original", copy.deepcopy(original)),
                         ("loaded", infinity.models.load(directory, cfg, window=WINDOW))):
        with infinity.initialize(model, cfg) as engine:
            losses[label] = train_lm(engine, batches(1) * 4)  # one batch again: the loss must fall
            params[label] = dict(engine.named_parameters())
    assert losses["loaded"] == losses["original"]
    assert losses["loaded"][-1] < losses["loaded"][0]
    assert params["loaded"].keys() == params["original"].keys()
    for name, value in params["original"].items():
        assert torch.equal(params["loaded"][name], value), name


def test_the_trace_puts_store_moves_and_engine_regions_on_one_clock(tmp_path, train_lm):
    """The store of a loaded model is older than its engine (by the load: 12 s at 7 B); the
    trace must still show each move when it happened against forward, backward and step."""
    cfg = config(tmp_path)
    model = infinity.models.load(saved(tmp_path, tiny_llama()), cfg, window=WINDOW)
    time.sleep(0.5)  # the load's end to the engine's start
    with infinity.initialize(model, cfg) as engine:
        start = time.perf_counter()
        train_lm(engine, batches(1))
        end = time.perf_counter()
        engine.write_trace(tmp_path / "trace.json")
        t0 = engine.timeline.t0
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
              if e["ph"] == "X"]

    def seconds(e):  # start and end on the perf_counter clock
        return t0 + e["ts"] / 1e6, t0 + (e["ts"] + e["dur"]) / 1e6

    regions = {e["name"]: seconds(e) for e in events if e.get("cat") == "compute"}
    assert start <= regions["forward"][0] < regions["step"][1] <= end
    moves = [seconds(e) for e in events if e["pid"] == 1]
    assert [m for m in moves if m[1] < start]  # the load's writes, before the engine began
    during = [m for m in moves if m[0] >= start]
    assert during and all(m[1] <= end for m in during)  # the step's reads, inside it


def test_a_tensor_larger_than_the_window_goes_in_slices(tmp_path, monkeypatch):
    """vocab x hidden fp32 = 2 MiB against a 1 MiB window (slices of 128 Ki elements)."""
    original = tiny_llama(vocab_size=16384)
    directory = saved(tmp_path, original, shard="1MB")
    cfg = config(tmp_path)
    pieces: dict[str, list[int]] = {}
    put_chunks = TensorStore.put_chunks

    def counting(self, key, shape, dtype, chunks, tier):
        counted = (pieces.setdefault(key, []).append(c.numel()) or c for c in chunks)
        return put_chunks(self, key, shape, dtype, counted, tier)

    monkeypatch.setattr(TensorStore, "put_chunks", counting)
    model = infinity.models.load(directory, cfg, window=WINDOW)
    assert pieces["param/model.embed_tokens"] == [128 << 10] * 4
    with infinity.initialize(model, cfg) as engine:
        got = dict(engine.named_parameters())
    assert torch.equal(got["model.embed_tokens.weight"], original.model.embed_tokens.weight)


def test_bf16_shards_load_into_fp32_parameters(tmp_path):
    original = tiny_llama().to(torch.bfloat16)
    directory = saved(tmp_path, original)
    cfg = config(tmp_path)
    model = infinity.models.load(directory, cfg, window=WINDOW)
    with infinity.initialize(model, cfg) as engine:
        assert {u.dtype for u in engine.units} == {torch.float32}
        got = dict(engine.named_parameters())
    for name, p in original.named_parameters():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], p.float()), name


def test_fp32_shards_load_into_bf16_storage(tmp_path):
    original = tiny_llama()
    directory = saved(tmp_path, original)
    cfg = config(tmp_path, bf16=True)
    model = infinity.models.load(directory, cfg, window=WINDOW)
    with infinity.initialize(model, cfg) as engine:
        assert {u.dtype for u in engine.units} == {torch.bfloat16}
        got = dict(engine.named_parameters())
    for name, p in original.named_parameters():
        assert torch.equal(got[name], p.to(torch.bfloat16)), name


def test_parameters_at_home_on_the_host(tmp_path):
    original = tiny_llama()
    cfg = config(tmp_path, param="cpu")
    model = infinity.models.load(saved(tmp_path, original), cfg, window=WINDOW)
    ids = batches(1)[0]
    with infinity.initialize(model, cfg) as engine, torch.no_grad():
        assert engine.plan.param_home == Tier.HOST
        assert torch.equal(engine(ids).logits, original(ids).logits)


def test_initialize_with_another_config_is_an_error(tmp_path):
    directory = saved(tmp_path, tiny_llama())
    model = infinity.models.load(directory, config(tmp_path), window=WINDOW)
    with pytest.raises(ConfigError, match="parameter home"):
        infinity.initialize(model, config(tmp_path, param="cpu"))
    with pytest.raises(ConfigError, match="precision"):
        infinity.initialize(model, config(tmp_path, bf16=True))
    assert isinstance(model.infinity_placed, Placed)  # kept for the right config
    infinity.initialize(model, config(tmp_path)).close()
    assert not hasattr(model, "infinity_placed")  # adopted: the engine owns the store


def test_window_below_one_mib_is_refused(tmp_path):
    with pytest.raises(ValueError, match="window"):
        infinity.models.load(saved(tmp_path, tiny_llama()), config(tmp_path), window=4096)


# -- broken directories ---------------------------------------------------------------------------

def _index(directory: str) -> dict:
    with open(os.path.join(directory, "model.safetensors.index.json")) as f:
        return json.load(f)


def _write_index(directory: str, index: dict) -> None:
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)


def _shard_of(directory: str, tensor: str) -> str:
    return os.path.join(directory, _index(directory)["weight_map"][tensor])


def break_missing_shard(d):
    path = _shard_of(d, "model.norm.weight")
    os.remove(path)
    return path, None, "shard missing"


def break_index_names_absent_tensor(d):
    index = _index(d)
    index["weight_map"]["model.layers.0.mlp.up_proj.bias"] = (
        index["weight_map"]["model.norm.weight"])
    _write_index(d, index)
    return _shard_of(d, "model.norm.weight"), "model.layers.0.mlp.up_proj.bias", "not in this shard"


def break_truncated_shard(d):
    path = _shard_of(d, "model.layers.1.mlp.down_proj.weight")
    os.truncate(path, os.path.getsize(path) - 100)
    return path, "*", "truncated"


def break_header_length(d):
    path = _shard_of(d, "model.norm.weight")
    with open(path, "r+b") as f:
        f.write((1 << 40).to_bytes(8, "little"))
    return path, None, "truncated or corrupt"


def break_shape_against_config(d):
    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["intermediate_size"] = 48
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return (_shard_of(d, "model.layers.0.mlp.down_proj.weight"),
            "model.layers.0.mlp.down_proj.weight",
            r"shape \(32, 64\), the model built from .*config.json has \(32, 48\)")


def break_unknown_tensor(d):
    safetensors_torch.save_file({"model.extra.weight": torch.zeros(3)},
                                os.path.join(d, "extra.safetensors"))
    index = _index(d)
    index["weight_map"]["model.extra.weight"] = "extra.safetensors"
    _write_index(d, index)
    return (os.path.join(d, "extra.safetensors"), "model.extra.weight",
            "not a parameter of the model")


def break_missing_parameter(d):
    index = _index(d)
    del index["weight_map"]["model.layers.1.input_layernorm.weight"]
    _write_index(d, index)
    return d, "model.layers.1.input_layernorm.weight", "no tensor for parameter"


def _add_tensor(d, name, value):
    path = os.path.join(d, "extra.safetensors")
    safetensors_torch.save_file({name: value}, path)
    index = _index(d)
    index["weight_map"][name] = "extra.safetensors"
    _write_index(d, index)
    return path


def break_buffer_shape(d):
    path = _add_tensor(d, "model.rotary_emb.inv_freq", torch.ones(3))
    return path, "model.rotary_emb.inv_freq", r"has shape \(3,\), the model's buffer has \(4,\)"


def break_no_config(d):
    os.remove(os.path.join(d, "config.json"))
    return os.path.join(d, "config.json"), None, "config.json: missing"


def break_no_weights(d):
    os.remove(os.path.join(d, "model.safetensors.index.json"))
    return d, None, "no model.safetensors"


BREAKAGES = [break_missing_shard, break_index_names_absent_tensor, break_truncated_shard,
             break_header_length, break_shape_against_config, break_buffer_shape,
             break_unknown_tensor, break_missing_parameter, break_no_config, break_no_weights]


@pytest.mark.parametrize("breakage", BREAKAGES,
                         ids=[b.__name__.removeprefix("break_") for b in BREAKAGES])
def test_broken_directory_is_named(tmp_path, breakage):
    directory = saved(tmp_path, tiny_llama())
    path, tensor, message = breakage(directory)
    cfg = config(tmp_path)
    with pytest.raises(CheckpointError, match=message) as caught:
        infinity.models.load(directory, cfg, window=WINDOW)
    error = caught.value
    assert error.path == path and path in str(error)
    if tensor == "*":
        assert error.tensor is not None and repr(error.tensor) in str(error)
    elif tensor is not None:
        assert error.tensor == tensor and repr(tensor) in str(error)
    assert os.listdir(tmp_path / "swap") == []  # nothing was placed


def test_a_shard_truncated_after_indexing_is_named_while_reading(tmp_path, monkeypatch):
    from infinity.models import _load

    directory = saved(tmp_path, tiny_llama())
    victim = _shard_of(directory, "model.layers.1.self_attn.o_proj.weight")
    index = _load.index_checkpoint

    def index_then_truncate(d):
        records = index(d)
        os.truncate(victim, 64)
        return records

    monkeypatch.setattr(_load, "index_checkpoint", index_then_truncate)
    with pytest.raises(CheckpointError, match="truncated while reading") as caught:
        infinity.models.load(directory, config(tmp_path), window=WINDOW)
    assert caught.value.path == victim


def test_buffers_in_the_checkpoint_are_loaded(tmp_path):
    original = tiny_llama()
    directory = saved(tmp_path, original)
    halved = original.model.rotary_emb.inv_freq / 2
    _add_tensor(directory, "model.rotary_emb.inv_freq", halved)
    model = infinity.models.load(directory, config(tmp_path), window=WINDOW)
    assert torch.equal(model.model.rotary_emb.inv_freq, halved)


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        infinity.models.load(tmp_path / "nowhere", config(tmp_path))


class Scaled(torch.nn.Module):
    """A wrapper adding one parameter (`prepare`'s job in the tests below)."""

    def __init__(self, inner: torch.nn.Module, scale: torch.Tensor) -> None:
        super().__init__()
        self.inner, self.scale = inner, torch.nn.Parameter(scale)
        self.config = inner.config

    def forward(self, input_ids):
        return self.inner(input_ids).logits * self.scale


def test_prepare_wraps_freezes_and_adds_parameters_with_their_values(tmp_path):
    original = tiny_llama(tie=False)
    directory = saved(tmp_path, original)
    cfg = config(tmp_path)

    def prepare(model):
        model.requires_grad_(False)
        return Scaled(model, torch.full((64,), 2.0))

    model = infinity.models.load(directory, cfg, window=WINDOW, prepare=prepare)
    ids = batches(1)[0]
    with infinity.initialize(model, cfg) as engine:
        trained = [s.name for u in engine.units if u.requires_grad for s in u.slots]
        optimized = [getattr(u, "values_key", None) or u.key for u in engine.optimizer.units]
        assert trained == ["scale"] and optimized == [u.key for u in engine.units
                                                      if u.requires_grad]
        with torch.no_grad():
            got = engine(ids)
    with torch.no_grad():
        torch.testing.assert_close(got, original(ids).logits * 2.0)


def test_prepare_adding_a_parameter_without_values_is_refused(tmp_path):
    directory = saved(tmp_path, tiny_llama())
    with pytest.raises(ValueError, match="prepare added parameter 'scale' on the meta device"):
        infinity.models.load(directory, config(tmp_path),
                             prepare=lambda m: Scaled(m, torch.empty(64, device="meta")))


@pytest.mark.requires_cuda
@pytest.mark.parametrize("param", ["none", "nvme"])
def test_loads_onto_the_accelerator(tmp_path, param):
    """offload_param "none" puts the units straight into the device tier (put_chunks copies each
    slice to the GPU); "nvme" stages through host as usual. Logits equal the original's on GPU."""
    original = tiny_llama()
    cfg = config(tmp_path, param=param)
    model = infinity.models.load(saved(tmp_path, original), cfg, window=WINDOW)
    ids = batches(1)[0]
    with infinity.initialize(model, cfg) as engine, torch.no_grad():
        assert engine.plan.param_home == (Tier.DEVICE if param == "none" else Tier.NVME)
        assert model.model.rotary_emb.inv_freq.is_cuda
        got = engine(ids.cuda()).logits
    expected = original.cuda()(ids.cuda()).logits
    torch.testing.assert_close(got, expected)
