"""write_shards and write_random_model: shards safetensors reads, written one tensor at a time;
a random model directory that from_pretrained, AutoTokenizer and infinity.models.load take."""

import gc
import json
import weakref

import pytest
import torch
import transformers
from safetensors import safe_open

from infinity.models import (
    BYTE_BOS_ID,
    BYTE_EOS_ID,
    byte_tokenizer,
    plan_shards,
    write_random_model,
    write_shards,
)


def tiny_config(**overrides):
    shape = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
             "tie_word_embeddings": False, "bos_token_id": BYTE_BOS_ID,
             "eos_token_id": BYTE_EOS_ID}
    return transformers.LlamaConfig(**{**shape, **overrides})


def test_shards_read_back_equal_and_hold_at_most_the_limit(tmp_path):
    tensors = {"a": torch.arange(10, dtype=torch.float32),
               "b": torch.randn(3, 5).to(torch.bfloat16),
               "c": torch.ones(7, dtype=torch.int64),
               "d": torch.randn(2, 2, 2, dtype=torch.float16)}
    specs = [(n, t.shape, t.dtype) for n, t in tensors.items()]
    files = write_shards(tmp_path, specs, iter(tensors.items()), max_shard_bytes=60)
    assert [[s[0] for s in shard] for shard in plan_shards(specs, 60)] == [["a"], ["b"], ["c"],
                                                                           ["d"]]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 40 + 30 + 56 + 16
    assert [f.name for f in files][-1] == "model.safetensors.index.json" and len(files) == 5
    for name, want in tensors.items():
        with safe_open(str(tmp_path / index["weight_map"][name]), "pt") as f:
            assert torch.equal(f.get_tensor(name), want)
            assert f.metadata() == {"format": "pt"}


def test_a_tensor_unlike_the_plan_is_refused(tmp_path):
    specs = [("a", torch.Size([4]), torch.float32)]
    with pytest.raises(RuntimeError, match="got tensor 'a' .*float64 where the plan has 'a'"):
        write_shards(tmp_path, specs, iter([("a", torch.zeros(4, dtype=torch.float64))]),
                     max_shard_bytes=1 << 20)


def test_each_tensor_is_released_before_the_next_is_asked_for(tmp_path):
    alive = []

    def produce():
        for i in range(4):
            alive.append(weakref.ref(t := torch.full((256,), float(i))))
            gc.collect()
            assert sum(r() is not None for r in alive) == 1  # only the one being produced
            yield f"t{i}", t
            del t

    specs = [(f"t{i}", torch.Size([256]), torch.float32) for i in range(4)]
    write_shards(tmp_path, specs, produce(), max_shard_bytes=2048)


def test_random_model_loads_everywhere_and_is_seeded(tmp_path):
    count = write_random_model(tmp_path / "m", tiny_config(), seed=3, max_shard_bytes=8192)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", local_files_only=True)
    assert count == sum(p.numel() for p in model.parameters())
    assert (model.dtype == torch.bfloat16
            and len(list((tmp_path / "m").glob("model-*.safetensors"))) > 1)
    assert torch.equal(model.model.norm.weight, torch.ones(32, dtype=torch.bfloat16))
    q = model.model.layers[0].self_attn.q_proj.weight.float()
    assert 0.015 < q.std() < 0.025 and abs(q.mean()) < 0.005
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "m", local_files_only=True)
    assert (tokenizer.encode("hé") == byte_tokenizer().encode("hé")
            and len(tokenizer.encode("hé")) == 3)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BYTE_BOS_ID, BYTE_EOS_ID)
    write_random_model(tmp_path / "again", tiny_config(), seed=3)
    write_random_model(tmp_path / "other", tiny_config(), seed=4)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "again",
                                                              local_files_only=True)
    other = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "other",
                                                              local_files_only=True)
    assert all(torch.equal(a, b)
               for a, b in zip(model.parameters(), again.parameters(), strict=True))
    assert not torch.equal(model.lm_head.weight, other.lm_head.weight)


def test_tied_model_writes_the_weight_once(tmp_path):
    write_random_model(tmp_path / "m", tiny_config(tie_word_embeddings=True), dtype=torch.float32)
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert ("model.embed_tokens.weight" in index["weight_map"]
            and "lm_head.weight" not in index["weight_map"])
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m", local_files_only=True)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_an_existing_directory_is_never_written_over(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(FileExistsError, match="exists"):
        write_random_model(tmp_path / "m", tiny_config())
    assert list((tmp_path / "m").iterdir()) == []


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import infinity.models._random as random_model

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(random_model, "write_shards", broken)
    with pytest.raises(OSError, match="No space"):
        write_random_model(tmp_path / "m", tiny_config())
    assert list(tmp_path.iterdir()) == []
