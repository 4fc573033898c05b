"""Data: files and directories read, jsonl "text" fields, packing, the seed-stable shuffle, and
the built-in corpus equal to its generator."""

import json

import pytest
import torch

from infinity.errors import InputError
from infinity.models import BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE, byte_tokenizer
from infinity.train import corpus, models
from infinity.train.data import Batches, Rows, data_files, load_rows, pack, read_documents


def test_txt_jsonl_and_directories_are_read_in_a_stable_order(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.jsonl").write_text(json.dumps({"text": "third"}) + "\n\n"
                                              + json.dumps({"text": "fourth", "id": 4}) + "\n")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "notes.md").write_text("ignored")
    files = data_files(tmp_path)
    assert [f.name for f in files] == ["a.txt", "b.txt", "c.jsonl"]
    assert list(read_documents(files)) == ["first", "second", "third", "fourth"]


def test_packing_wraps_documents_in_bos_eos_and_drops_the_tail():
    tok = byte_tokenizer()
    rows = pack(iter(["ab", "", "cde"]), tok, 3, source="x")
    bos, eos = BYTE_BOS_ID, BYTE_EOS_ID
    assert rows.ids.tolist() == [[bos, 97, 98], [eos, bos, 99], [100, 101, eos]]
    assert rows.trained is None  # documents: every token trains
    rows = pack(iter(["abcd"]), tok, 4, source="x")  # 6 tokens: one row, tail of 2 dropped
    assert rows.ids.tolist() == [[bos, 97, 98, 99]]


def test_byte_tokens_are_the_utf8_bytes_whatever_the_text_holds():
    """Token i is byte i, so the built-in model's ids mean the same in training and in an
    exported model; text that looks like a special token stays bytes."""
    tok = byte_tokenizer()
    text = "hé wörld\x00\n\t  ~日本 <s></s><pad> \U0001f600"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8"))
    special = (BYTE_BOS_ID, BYTE_EOS_ID, BYTE_PAD_ID, BYTE_VOCAB_SIZE)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok)) == special
    assert special == (256, 257, 258, 259)  # pinned: exported models were trained on these ids
    assert tok.decode([BYTE_BOS_ID, *ids, BYTE_EOS_ID], skip_special_tokens=True) == text


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing.txt", "no such file"),
    (lambda p: (p / "empty.txt").write_text("  \n") and p / "empty.txt", "no text"),
    (lambda p: (p / "short.txt").write_text("hi") and p / "short.txt",
     "not enough for one sequence"),
    (lambda p: (p / "d").mkdir() or p / "d", "no .txt, .jsonl, .json or .parquet file"),
    (lambda p: (p / "x.csv").write_text("a") and p / "x.csv", "not a .txt, .jsonl, .json or"),
    (lambda p: (p / "x.jsonl").write_text('{"body": "a"}\n') and p / "x.jsonl",
     'x.jsonl:1: no string field "text"'),
    (lambda p: (p / "y.jsonl").write_text('{"text": "a"}\n{oops\n') and p / "y.jsonl",
     "y.jsonl:2: not JSON"),
])
def test_bad_data_names_the_culprit(tmp_path, make, message):
    with pytest.raises(InputError, match=message):
        load_rows(make(tmp_path), byte_tokenizer(), 16)


def test_shuffle_is_seed_stable_and_covers_every_row_each_epoch():
    rows = Rows(torch.arange(10).view(10, 1))
    first = [b.ids.flatten().tolist() for _, b in zip(range(5), Batches(rows, 4, seed=3))]
    again = [b.ids.flatten().tolist() for _, b in zip(range(5), Batches(rows, 4, seed=3))]
    other = [b.ids.flatten().tolist() for _, b in zip(range(5), Batches(rows, 4, seed=4))]
    assert first == again and first != other
    assert all(len(b) == 4 for b in first)
    flat = sum(first, [])
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))


def test_the_shipped_corpus_is_the_generators_output():
    assert (models.DEFAULTS / "corpus.txt").read_text() == corpus.generate()


def test_rows_are_compact_and_batches_are_model_inputs():
    rows = pack(iter(["abcdefgh"] * 4), byte_tokenizer(), 5, source="x")
    assert rows.ids.dtype == torch.int32 and rows.ids.shape == (8, 5)
    batch = next(Batches(rows, 3))
    assert batch.ids.dtype == torch.int64 and batch.ids.shape == (3, 5)
    assert batch.labels is batch.ids and batch.trained_tokens == 3 * 4  # the model shifts


def test_batches_seek_continues_where_a_run_stopped():
    rows = Rows(torch.arange(7 * 3).view(7, 3))
    first = Batches(rows, 3, seed=5)
    taken = [next(first).ids for _ in range(4)]  # crosses an epoch boundary (7 rows, 3 a batch)
    resumed = Batches(rows, 3, seed=5)
    resumed.seek(first.epoch, first.position)
    assert all(next(resumed).ids.equal(next(first).ids) for _ in range(5))
    fresh = Batches(rows, 3, seed=5)
    fresh.seek(-1, 0)  # a run saved before its first batch
    assert next(fresh).ids.equal(taken[0])
