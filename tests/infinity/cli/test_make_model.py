"""infinity-make-model: writes a random Llama directory of the asked shape that infinity-train
trains; bad shapes and an existing directory are one line and exit 2."""

import json

import pytest

from infinity.cli import make_model
from infinity.models import BYTE_PAD_ID, BYTE_VOCAB_SIZE

SHAPE = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4",
         "--kv-heads", "2",
         "--vocab", "320", "--max-positions", "128"]


def test_writes_the_asked_shape_and_counts_its_parameters(tmp_path, capsys):
    assert make_model.main([str(tmp_path / "m"), *SHAPE, "--max-shard-size", "64K"]) == 0
    out = capsys.readouterr().out
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"],
            config["num_key_value_heads"], config["vocab_size"]) == (2, 64, 128, 2, 320)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["dtype"] == "bfloat16"
    per_layer = 2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64
    count = 2 * per_layer + 2 * 320 * 64 + 64
    assert f"Llama of {count / 1e3:.3g} K parameters ({count})" in out
    shards = [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]  # 230,016 bytes in 64K
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == sorted(
        ["config.json", *shards, "model.safetensors.index.json", "tokenizer.json",
         "tokenizer_config.json"])


@pytest.mark.parametrize("args, message", [
    (["--heads", "5"], "--hidden 256, --heads 5, --kv-heads 5: hidden must divide by heads"),
    (["--heads", "8", "--kv-heads", "3"],
     "--kv-heads 3: hidden must divide by heads, and heads by kv-heads"),
    (["--vocab", str(BYTE_VOCAB_SIZE - 1)],
     f"--vocab {BYTE_VOCAB_SIZE - 1}: at least {BYTE_VOCAB_SIZE}"),
    (["--layers", "0"], "--layers 0: must be at least 1"),
])
def test_bad_shapes_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    assert make_model.main([str(tmp_path / "m"), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_an_existing_directory_is_refused(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    assert make_model.main([str(tmp_path / "m")]) == 2
    assert "exists" in capsys.readouterr().err


def test_the_default_vocab_holds_every_token_of_its_tokenizer(tmp_path, capsys):
    """<pad> (258) was beyond the default vocab of 258: padding a batch was an IndexError."""
    transformers = pytest.importorskip("transformers")
    assert make_model.main([str(tmp_path / "m"), "--layers", "1", "--hidden", "32",
                            "--intermediate", "64", "--heads", "4"]) == 0
    count = 32 * 32 * 4 + 3 * 32 * 64 + 2 * 32 + 2 * BYTE_VOCAB_SIZE * 32 + 32  # 2 embeddings
    out = capsys.readouterr().out
    assert f"Llama of {count / 1e3:.3g} K parameters ({count})" in out  # not "0.000 B"
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["vocab_size"] == len(tokenizer) == BYTE_VOCAB_SIZE
    assert config["pad_token_id"] == tokenizer.pad_token_id == BYTE_PAD_ID
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    batch = tokenizer(["a", "abc"], padding=True, return_tensors="pt")
    assert batch.input_ids.max() == tokenizer.pad_token_id
    model(**batch)  # every id has an embedding row
