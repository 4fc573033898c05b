"""Export: a tiny save_pretrained model fine-tuned through the engine comes back through
from_pretrained with the engine's own logits; LoRA trains only the adapters (base weights never
written, no optimizer state) and exports merged."""

import json

import peft
import pytest
import torch
import transformers

from infinity.engine import initialize
from infinity.train import models
from infinity.train.export import write_adapter, write_hf


def nvme_config(tmp_path) -> dict:
    config = json.loads((models.DEFAULTS / "ds_config.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 2
    config["optimizer"]["params"]["lr"] = 1e-2
    zero = config["zero_optimization"]
    zero["stage3_param_persistence_threshold"] = 0
    for key in ("offload_param", "offload_optimizer"):
        zero[key]["nvme_path"] = str(tmp_path / "nvme")
    (tmp_path / "nvme").mkdir(exist_ok=True)
    return config


def streamed(directory, config, lora=None):
    """The engine of `directory` streamed into the store as infinity-train loads it."""
    return initialize(models.load_model(directory, config, lora=lora), config)


def fine_tune(engine, steps=3, vocab=256):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 16), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()


def logits_of(model_or_engine, ids):
    with torch.no_grad():
        return model_or_engine(input_ids=ids).logits


def test_export_round_trip_gives_the_engines_logits(tmp_path, tiny_hf_model):
    engine = streamed(tiny_hf_model, nvme_config(tmp_path))
    before = dict(engine.named_parameters())
    fine_tune(engine)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    engine.eval()
    want = logits_of(engine, ids)
    out = tmp_path / "out"
    files = write_hf(engine, out, tokenizer=models.load_tokenizer(tiny_hf_model),
                     max_shard_bytes=40_000)
    after = dict(engine.named_parameters())
    engine.close()
    assert any(not torch.equal(before[n], after[n]) for n in before)  # it did train
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and set(shards) <= set(files)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert (set(index["weight_map"]) == set(before)
            and set(index["weight_map"].values()) == {s.name for s in shards})
    assert (out / "tokenizer.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert torch.equal(logits_of(loaded.eval(), ids), want)
    assert transformers.AutoTokenizer.from_pretrained(out, local_files_only=True).encode("hi") \
        == models.load_tokenizer(tiny_hf_model).encode("hi")


def _writes_by_key(engine, path):
    engine.write_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    counts = {}
    for e in events:
        if e.get("cat") == "host->nvme":
            counts[e["name"]] = counts.get(e["name"], 0) + 1
    return counts


def test_lora_trains_only_the_adapters_and_exports_merged(tmp_path, tiny_hf_model):
    engine = streamed(tiny_hf_model, nvme_config(tmp_path), lora=4)
    trained = {u.key for u in engine.units if u.requires_grad}
    assert trained and all(".lora_" in k for k in trained)
    optimized = {getattr(u, "values_key", None) or u.key for u in engine.optimizer.units}
    assert optimized == trained  # no optimizer state for any base weight
    base = dict(engine.named_parameters(lambda n: ".lora_" not in n))
    adapters = dict(engine.named_parameters(lambda n: ".lora_" in n))
    written_at_start = _writes_by_key(engine, tmp_path / "t0.json")
    fine_tune(engine)
    written = _writes_by_key(engine, tmp_path / "t1.json")
    frozen_keys = {u.key for u in engine.units if not u.requires_grad}
    assert ({k: written.get(k, 0) for k in frozen_keys}
            == {k: written_at_start.get(k, 0) for k in frozen_keys})
    assert any(written.get(k, 0) > written_at_start.get(k, 0) for k in trained)
    after_base = dict(engine.named_parameters(lambda n: ".lora_" not in n))
    assert all(torch.equal(base[n], after_base[n]) for n in base)
    after_adapters = dict(engine.named_parameters(lambda n: ".lora_" in n))
    assert any(not torch.equal(adapters[n], after_adapters[n]) for n in adapters)

    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    engine.eval()
    want = logits_of(engine, ids)
    write_hf(engine, tmp_path / "merged")
    engine.close()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                               local_files_only=True)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits_of(merged.eval(), ids), want, rtol=1e-5, atol=1e-5)


def test_lora_adapter_export_loads_with_peft(tmp_path, tiny_hf_model):
    engine = streamed(tiny_hf_model, nvme_config(tmp_path), lora=2)
    fine_tune(engine)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    engine.eval()
    want = logits_of(engine, ids)
    write_adapter(engine, tmp_path / "adapter")
    engine.close()
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json",
                                                                        "adapter_model.safetensors"]
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_model, local_files_only=True)
    loaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter")
    torch.testing.assert_close(logits_of(loaded.eval(), ids), want, rtol=1e-5, atol=1e-5)


def test_adapter_export_needs_a_lora_model(tmp_path, tiny_hf_model):
    engine = streamed(tiny_hf_model, nvme_config(tmp_path))
    try:
        with pytest.raises(ValueError, match="needs a peft model"):
            write_adapter(engine, tmp_path / "adapter")
    finally:
        engine.close()


def test_tied_embeddings_export_once_and_load_tied(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=32,
                                      tie_word_embeddings=True)
    engine = initialize(transformers.LlamaForCausalLM(config), nvme_config(tmp_path))
    fine_tune(engine, steps=2, vocab=64)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(2))
    engine.eval()
    want = logits_of(engine, ids)
    write_hf(engine, tmp_path / "out")
    engine.close()
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert ("model.embed_tokens.weight" in index["weight_map"]
            and "lm_head.weight" not in index["weight_map"])
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out",
                                                               local_files_only=True).eval()
    assert loaded.lm_head.weight is loaded.get_input_embeddings().weight
    assert torch.equal(logits_of(loaded, ids), want)


def test_lora_trains_under_a_host_budget_below_the_frozen_model(tmp_path):
    """Frozen base units are released after their module's backward (not held to its end), so
    a host budget smaller than the frozen weights (3.2 MB here) is enough."""
    model, _ = models.default_model()
    frozen_nbytes = sum(p.numel() * 4 for p in model.parameters())
    model = models.add_lora(model, 4)
    config = nvme_config(tmp_path)
    config["infinity"]["host_memory_budget"] = 2_000_000
    assert frozen_nbytes > 3_000_000
    engine = initialize(model, config)
    try:
        fine_tune(engine, steps=2)
        assert engine.global_steps == 2
    finally:
        engine.close(restore_params=False)


def test_lora_adapters_on_a_streamed_model_start_as_peft_initialises_them(tmp_path, tiny_hf_model):
    """The adapters of a model streamed in (its base built on meta) get real values: A random,
    B zero, so the model starts equal to its base."""
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_model,
                                                             local_files_only=True).eval()
    engine = streamed(tiny_hf_model, nvme_config(tmp_path), lora=4)
    try:
        adapters = dict(engine.named_parameters(lambda n: ".lora_" in n))
        assert adapters and all(t.abs().sum() > 0 for n, t in adapters.items() if ".lora_A." in n)
        assert all(not t.any() for n, t in adapters.items() if ".lora_B." in n)
        engine.eval()
        torch.testing.assert_close(logits_of(engine, ids), logits_of(base, ids),
                                   rtol=1e-5, atol=1e-5)
    finally:
        engine.close()


def test_the_export_size_counts_a_folders_weights_once(tmp_path):
    """What infinity-train keeps free for the export: the model folder's safetensors files, or
    its .bin files where it has no safetensors (never both: they hold the same weights)."""
    from infinity.train.export import export_nbytes
    (tmp_path / "config.json").write_bytes(b"x" * 1000)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 300)
    assert export_nbytes(str(tmp_path), None) == 300
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 70)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 30)
    assert export_nbytes(str(tmp_path), None) == 100
    model = torch.nn.Linear(4, 3)  # the built-in model: its tensors' bytes
    assert export_nbytes(None, model) == (4 * 3 + 3) * 4
