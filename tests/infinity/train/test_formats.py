"""--data formats beyond .txt/.jsonl (datasets folders, parquet/json files, a cached dataset
id, --text-field), chat conversations trained on their assistant turns only, the evaluation
split, and the tokenized-data cache."""

import json
import shutil

import pytest
import torch
from chat_data import CHAT, TEMPLATE, chat_tokenizer

from infinity.errors import InputError, described
from infinity.models import byte_tokenizer
from infinity.train import cache
from infinity.train.data import IGNORE, Batches, Rows, as_batch, load_rows, pack, split_rows

DOCS = [f"document number {i} says something about the weather. " * 2 for i in range(12)]


def test_datasets_folders_parquet_and_json_files_pack_as_jsonl_does(tmp_path):
    datasets = pytest.importorskip("datasets")
    tok = byte_tokenizer()
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in DOCS))
    expected = load_rows(tmp_path / "docs.jsonl", tok, 32, text_field="body")
    data = datasets.Dataset.from_dict({"body": DOCS, "id": list(range(len(DOCS)))})
    data.save_to_disk(str(tmp_path / "saved"))
    splits = datasets.DatasetDict({"train": data, "test": data.select([0])})
    splits.save_to_disk(str(tmp_path / "dict"))
    data.to_parquet(str(tmp_path / "docs.parquet"))
    data.to_json(str(tmp_path / "docs.json"))
    for spec in ("saved", "dict", "docs.parquet", "docs.json"):
        rows = load_rows(tmp_path / spec, tok, 32, text_field="body")
        assert rows.ids.equal(expected.ids), spec
    with pytest.raises(InputError, match='saved record 1: no string field "text" \\(--text-field'):
        load_rows(tmp_path / "saved", tok, 32)


def test_a_datasets_folder_without_a_train_split_or_a_corrupt_file_is_one_line(tmp_path):
    """Several splits and none "train": which to read is not guessed; a .parquet that is not
    one names the file and the builder."""
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"text": DOCS})
    datasets.DatasetDict({"a": data, "b": data}).save_to_disk(str(tmp_path / "dict"))
    tok = byte_tokenizer()
    with pytest.raises(InputError, match="dict: splits a, b and none is 'train'"):
        load_rows(tmp_path / "dict", tok, 32)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match=r"bad.parquet: cannot read it as parquet \(\w+"):
        load_rows(tmp_path / "bad.parquet", tok, 32)


def test_a_library_error_is_described_by_its_type_and_first_line():
    assert described(ValueError("bad footer\nat offset 12")) == "ValueError: bad footer"
    assert described(OSError()) == "OSError"


def test_a_cached_dataset_id_is_read_offline(tmp_path, monkeypatch):
    """A Hub dataset once downloaded (prepared in the datasets cache) trains by its id; one
    not in the cache is one line, not a download."""
    datasets = pytest.importorskip("datasets")
    from datasets.data_files import DataFilesDict
    from datasets.packaged_modules.json.json import Json

    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    builder = Json(cache_dir=str(tmp_path / "build"), dataset_name="tiny",
                   data_files=DataFilesDict.from_patterns({"train": [str(tmp_path / "t.jsonl")]}))
    builder.download_and_prepare()
    # where load_dataset("owner/tiny") prepares it: <owner>___<name>/<config>/<version>/<hash>
    prepared = tmp_path / "cache" / "owner___tiny" / "default" / "0.0.0" / "abc"
    shutil.copytree(builder.cache_dir, prepared)
    tok = byte_tokenizer()
    monkeypatch.chdir(tmp_path)  # "owner/tiny" is no path here
    rows = load_rows("owner/tiny", tok, 32)
    assert rows.ids.equal(load_rows(tmp_path / "t.jsonl", tok, 32).ids)
    assert cache.data_fingerprint("owner/tiny")[:2] == ["dataset", "owner/tiny"]
    with pytest.raises(InputError, match="--data owner/other: no such file or directory, nor a "
                                         "dataset in the local"):
        load_rows("owner/other", tok, 32)


def test_without_datasets_those_formats_say_what_to_install(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_datasets(name, *args, **kwargs):
        if name == "datasets" or name.startswith("datasets."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_datasets)
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    with pytest.raises(InputError, match=r"needs the datasets package "
                                         r"\(pip install 'infinity\[data\]'\)"):
        load_rows(tmp_path / "x.parquet", byte_tokenizer(), 16)


def test_chat_trains_on_the_assistant_turns_only():
    """Every prompt token (system, user, the assistant header) is masked; the assistant's
    words and the newline that closes its turn are trained, as TRL's assistant_only_loss."""
    tok = chat_tokenizer()
    text = tok.apply_chat_template(CHAT, tokenize=False)
    rows = pack(iter([CHAT]), tok, len(text.encode()), source="x")  # one row: the conversation
    assert rows.ids[0].tolist() == list(text.encode())
    trained = bytes(t for t, keep in zip(rows.ids[0].tolist(), rows.trained[0].tolist()) if keep)
    assert trained == b"Hello.\nBlue.\n"
    batch = as_batch(rows)
    assert batch.trained_tokens == len(b"Hello.\nBlue.\n")
    assert (batch.labels == IGNORE).sum() == len(text.encode()) - batch.trained_tokens


def test_chat_rows_without_a_trained_token_are_dropped():
    tok = chat_tokenizer()
    long_prompt = [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "ok"}]
    rows = pack(iter([long_prompt] * 3), tok, 8, source="x")
    assert len(rows) > 0 and all(r[1:].any() for r in rows.trained)  # only rows with targets


@pytest.mark.parametrize("messages, message", [
    ([{"role": "user", "content": "hi"}], "no assistant message"),
    ([{"role": "robot", "content": "hi"}], "message 0 is not"),
    ("hello", '"messages" is not a non-empty list'),
    ([{"role": "assistant", "content": "hi"}], "message 0 is the assistant's: nothing prompts"),
])
def test_bad_chat_lines_name_the_line(tmp_path, messages, message):
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n"
                                      + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(InputError, match=f"c.jsonl:2: {message}"):
        load_rows(tmp_path / "c.jsonl", chat_tokenizer(), 8)


def test_chat_needs_a_chat_template(tmp_path):
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    with pytest.raises(InputError, match="chat messages need a tokenizer with a chat template"):
        load_rows(tmp_path / "c.jsonl", byte_tokenizer(), 8)


@pytest.mark.parametrize("template, message", [
    ("{% if messages[0]['role'] == 'tool' %}{{ raise_exception('no tool calls here') }}"
     "{% endif %}" + TEMPLATE,
     "the chat template fails on this conversation (TemplateError: no tool calls here)"),
    ("{% if messages[0]['role'] == 'tool' %}{{ 1 // 0 }}{% endif %}" + TEMPLATE,
     "the chat template fails on this conversation (ZeroDivisionError: "),
    ("{% if messages[0]['role'] == 'tool' and messages | length == 2 %}two: {% endif %}"
     + TEMPLATE,
     "the chat template does not render this conversation turn by turn"),
], ids=["raise_exception", "python error", "not turn by turn"])
def test_a_conversation_the_template_fails_on_names_its_line(tmp_path, template, message):
    """A template that raises (many refuse roles out of turn) or cannot be split into turns is
    one line naming the record, not a jinja2 traceback or only the --data source."""
    tok = chat_tokenizer()
    tok.chat_template = template
    tool = [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "It is 42."}]
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n\n"
                                      + json.dumps({"messages": tool}) + "\n")
    with pytest.raises(InputError) as caught:
        load_rows(tmp_path / "c.jsonl", tok, 8)
    assert f"--data {tmp_path / 'c.jsonl'}:3: {message}" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_chat_with_no_trained_token_in_any_row_or_an_unsplittable_template_is_refused():
    """The only assistant turn lies in the tail packing drops: no row would train; a template
    whose start depends on the whole conversation cannot tell the turns apart."""
    tok = chat_tokenizer()
    late = [{"role": "user", "content": "x" * 100}, {"role": "assistant", "content": "ok"}]
    with pytest.raises(InputError, match="--data x: no row of --seq-len 64 holds an assistant"):
        pack(iter([late]), tok, 64, source="x")
    tok.chat_template = "{{ messages | length }}" + tok.chat_template
    with pytest.raises(InputError, match="--data x: the chat template does not render this "
                                         "conversation turn by turn"):
        pack(iter([CHAT]), tok, 4, source="x")


def test_mixed_text_and_chat_batches_mask_only_the_prompts():
    tok = chat_tokenizer()
    rows = pack(iter(["plain text here", CHAT]), tok, 4, source="x")
    batches = Batches(rows, len(rows))
    batch = next(batches)
    assert 0 < batch.trained_tokens < batch.ids.numel()


def test_the_eval_split_is_seeded_and_disjoint():
    rows = Rows(torch.arange(40).view(20, 2))
    train, held = split_rows(rows, 0.25, seed=1)
    again, _ = split_rows(rows, 0.25, seed=1)
    assert len(held) == 5 and len(train) == 15 and train.ids.equal(again.ids)
    assert not set(held.ids[:, 0].tolist()) & set(train.ids[:, 0].tolist())
    with pytest.raises(InputError, match="--eval-split 1.5: a share"):
        split_rows(rows, 1.5, 0)
    with pytest.raises(InputError, match="too few"):
        split_rows(Rows(torch.zeros(1, 2)), 0.5, 0)


def test_the_cache_key_follows_data_tokenizer_and_seq_len(tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("some text " * 50)
    tok = byte_tokenizer()
    key = cache.key(cache.data_fingerprint(str(data)), tok, 16, "text")
    assert key == cache.key(cache.data_fingerprint(str(data)), byte_tokenizer(), 16, "text")
    assert key != cache.key(cache.data_fingerprint(str(data)), tok, 32, "text")
    assert key != cache.key(cache.data_fingerprint(str(data)), chat_tokenizer(), 16, "text")
    assert key != cache.key(cache.data_fingerprint(str(data)), tok, 16, "body")
    data.write_text("other text " * 50)
    assert key != cache.key(cache.data_fingerprint(str(data)), tok, 16, "text")


def test_cached_rows_come_back_and_a_foreign_file_is_ignored(tmp_path):
    tok = chat_tokenizer()
    rows = pack(iter([CHAT] * 4), tok, 8, source="x")
    key = cache.key(["x"], tok, 8, "text")
    path = cache.save(tmp_path, key, rows)
    back = cache.load(tmp_path, key, 8)
    assert back.ids.equal(rows.ids) and back.trained.equal(rows.trained)
    assert cache.load(tmp_path, key, 16) is None  # another --seq-len
    other = cache.key(["y"], tok, 8, "text")
    assert cache.load(tmp_path, other, 8) is None
    shutil.copyfile(path, cache.path(tmp_path, other))  # a file under another key's name
    assert cache.load(tmp_path, other, 8) is None
    cache.path(tmp_path, key).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    assert cache.load(tmp_path, key, 8) is None  # corrupt: tokenized again, never trusted


def test_a_cache_write_that_fails_leaves_no_partial_file(tmp_path, monkeypatch):
    """A full disk while caching (in --output itself under --resume): the error goes up and
    neither the cache file nor its partial copy stays."""
    import errno

    def full(tensors, filename, metadata):
        with open(filename, "wb") as f:
            f.write(b"half")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache, "save_file", full)
    rows = Rows(torch.zeros(2, 8, dtype=torch.int32))
    with pytest.raises(OSError, match="No space left"):
        cache.save(tmp_path, cache.key(["x"], byte_tokenizer(), 8, "text"), rows)
    assert list((tmp_path / cache.SUBDIR).iterdir()) == []
