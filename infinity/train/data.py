"""Training data: read it, tokenize, pack into fixed-length rows, and serve micro-batches in a
seed-stable shuffled order.

--data is a .txt file (one document), a .jsonl file (one example per line), a directory of
them (recursive, sorted by path); with the `datasets` package also .parquet / .json files, a
folder `save_to_disk` wrote, or the id of a dataset in the local cache (infinity/train/
sources.py). An example is a document (the string in its --text-field, "text" by default) or
a conversation (a "messages" list, infinity/train/chat.py: only the assistant turns train).

Packing concatenates the examples (a document as bos + tokens + eos where the tokenizer has
them, a conversation as its chat template renders it) and cuts the stream into rows of
`seq_len` tokens; the tail shorter than a row is dropped, and so is a row with no trained
token to predict. Every epoch is a permutation of the rows drawn from `seed + epoch`, so a run
is reproducible.
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from infinity.errors import InputError
from infinity.train import bars, chat, sources

logger = logging.getLogger(__name__)

SUFFIXES = (".txt", ".jsonl")
IGNORE = -100  # label of a position the loss skips (transformers' ignore_index)
_ESCAPED = re.compile("[\udc80-\udcff]")  # bytes surrogateescape could not decode


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass
class Rows:
    """Packed token rows (int32 [rows, seq_len]) and which positions are trained (bool, same
    shape; None: every one)."""

    ids: torch.Tensor
    trained: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def select(self, index: torch.Tensor) -> Rows:
        return Rows(self.ids[index], None if self.trained is None else self.trained[index])


def data_files(path: str | pathlib.Path) -> list[pathlib.Path]:
    """The data files `path` names: itself, or those under it (sorted, recursive)."""
    path = pathlib.Path(path)
    known = SUFFIXES + tuple(sources.SUFFIXES)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in known)
        if not files:
            raise InputError(f"--data {path}: no .txt, .jsonl, .json or .parquet file in this "
                             "directory")
        return files
    if not path.exists():
        raise InputError(f"--data {path}: no such file or directory")
    if path.suffix not in known:
        raise InputError(f"--data {path}: not a .txt, .jsonl, .json or .parquet file (or a "
                         "directory of them, or a datasets folder)")
    if not path.is_file():  # a FIFO or device would block or never end
        raise InputError(f"--data {path}: not a regular file")
    return [path]


def _decode(raw: bytes, replaced: list[int]) -> str:
    """`raw` as UTF-8, each invalid byte replaced by U+FFFD and counted in replaced[0]
    (surrogateescape turns each into one lone surrogate, which valid UTF-8 never gives)."""
    text, count = _ESCAPED.subn("\ufffd", raw.decode("utf-8", errors="surrogateescape"))
    replaced[0] += count
    return text


def example_of(record: Any, text_field: str, where: str) -> str | list[dict[str, str]]:
    """A record's document (its `text_field` string) or conversation (its "messages")."""
    if isinstance(record, dict) and record.get("messages") is not None:
        return chat.check_messages(record["messages"], where)
    text = record.get(text_field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        hint = "" if text_field != "text" else " (--text-field names another)"
        raise InputError(f"--data {where}: no string field \"{text_field}\"{hint}")
    return text


def _jsonl_records(path: pathlib.Path, replaced: list[int]) -> Iterator[tuple[Any, str]]:
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            line = _decode(raw, replaced)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"--data {path}:{number}: not JSON ({e.msg})") from None
            except RecursionError:
                raise InputError(f"--data {path}:{number}: not JSON (nested too deep)") from None
            yield record, f"{path}:{number}"


def read_documents(files: list[pathlib.Path], text_field: str = "text"
                   ) -> Iterator[str | list[dict[str, str]]]:
    """Each .txt file is one document; each line of a .jsonl file and each record of a
    .json / .parquet file is one example. Bytes of .txt / .jsonl that are not UTF-8 become
    U+FFFD, and a warning says how many there were."""
    for path in files:
        replaced = [0]
        if path.suffix == ".txt":
            yield _decode(path.read_bytes(), replaced)
        else:
            records = _jsonl_records(path, replaced) if path.suffix == ".jsonl" else \
                ((r, f"{path} record {i}") for i, r in enumerate(sources.read_file(path), 1))
            for record, where in records:
                yield example_of(record, text_field, where)
        if replaced[0]:
            logger.warning("--data %s: %d bytes are not UTF-8; each was read as U+FFFD", path,
                           replaced[0])


def read_examples(spec: str | pathlib.Path, text_field: str = "text"
                  ) -> Iterator[str | list[dict[str, str]]]:
    """The examples --data names (see the module docstring)."""
    path = pathlib.Path(spec)
    if sources.is_saved_dataset(path):
        records = sources.read_saved(path)
    elif not path.exists() and sources.looks_like_id(str(spec)):
        records = sources.read_cached(str(spec))
    else:
        yield from read_documents(data_files(path), text_field)
        return
    for number, record in enumerate(records, 1):
        yield example_of(record, text_field, f"{spec} record {number}")


def tokenize(example: str | list[dict[str, str]], tokenizer: Tokenizer, where: str
             ) -> tuple[list[int], list[bool] | None]:
    """(token ids, which are trained: None for a document, whose every token is)."""
    if isinstance(example, list):
        return chat.tokenize_chat(tokenizer, example, where)
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    return bos + tokenizer.encode(example, add_special_tokens=False) + eos, None


def pack(examples: Iterator[Any], tokenizer: Tokenizer, seq_len: int, *, source: str,
         progress: bool = False) -> Rows:
    """Rows of `seq_len` tokens (int32: 4 bytes a token; batches come out as int64);
    InputError when the data fills not even one row."""
    ids: list[torch.Tensor] = []
    trained: list[torch.Tensor | None] = []
    for example in bars.bar(examples, desc="tokenizing", unit=" examples", shown=progress):
        if isinstance(example, str) and not example.strip():
            continue
        piece, mask = tokenize(example, tokenizer, source)
        ids.append(torch.tensor(piece, dtype=torch.int32))
        trained.append(None if mask is None else torch.tensor(mask, dtype=torch.bool))
    tokens = sum(len(p) for p in ids)
    rows = tokens // seq_len
    if rows == 0:
        raise InputError(f"--data {source}: {tokens} tokens of text, not enough for one "
                         f"sequence of --seq-len {seq_len}" if tokens else
                         f"--data {source}: no text")
    packed = Rows(torch.cat(ids)[:rows * seq_len].view(rows, seq_len))
    if any(m is not None for m in trained):
        masks = [torch.ones(len(p), dtype=torch.bool) if m is None else m
                 for p, m in zip(ids, trained)]
        packed.trained = torch.cat(masks)[:rows * seq_len].view(rows, seq_len)
        useful = packed.trained[:, 1:].any(dim=1)  # the first token of a row is never a target
        packed = packed.select(useful.nonzero().flatten())
        if len(packed) == 0:
            raise InputError(f"--data {source}: no row of --seq-len {seq_len} holds an "
                             "assistant token to train on")
    return packed


def split_rows(rows: Rows, share: float, seed: int) -> tuple[Rows, Rows]:
    """(train rows, eval rows): `share` of the rows (at least one), drawn with `seed`."""
    if not 0 < share < 1:
        raise InputError(f"--eval-split {share}: a share of the rows between 0 and 1 "
                         "(e.g. 0.05)")
    held = max(1, round(share * len(rows)))
    if held >= len(rows):
        raise InputError(f"--eval-split {share}: the data has {len(rows)} rows, too few to "
                         f"hold {held} out for evaluation")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))
    return rows.select(order[held:].sort().values), rows.select(order[:held].sort().values)


@dataclass
class Batch:
    """Model inputs of one micro-batch: ids and labels (int64; IGNORE where not trained)."""

    ids: torch.Tensor
    labels: torch.Tensor

    @property
    def trained_tokens(self) -> int:
        """Positions the loss counts (the model shifts: the first of each row is no target)."""
        return int((self.labels[:, 1:] != IGNORE).sum())


def as_batch(rows: Rows) -> Batch:
    ids = rows.ids.to(torch.int64)
    labels = ids if rows.trained is None else ids.masked_fill(~rows.trained, IGNORE)
    return Batch(ids, labels)


class Batches:
    """Micro-batches of packed rows, a fresh seeded permutation each epoch (endless)."""

    def __init__(self, rows: Rows, batch_size: int, seed: int = 0) -> None:
        if batch_size < 1:
            raise InputError(f"--batch-size {batch_size}: must be at least 1")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.epoch, self._order, self._next = -1, torch.empty(0, dtype=torch.int64), 0

    def __iter__(self) -> Iterator[Batch]:
        return self

    @property
    def position(self) -> int:
        """How many rows of the current epoch's permutation were served."""
        return self._next

    def seek(self, epoch: int, position: int) -> None:
        """Continue where a run that was at (`epoch`, `position`) stopped: the next batch is the
        one that run would have taken next."""
        self.epoch, self._order, self._next = epoch, torch.empty(0, dtype=torch.int64), 0
        if epoch >= 0:
            self._order = self._permutation(epoch)
            self._next = position

    def _permutation(self, epoch: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(len(self.rows), generator=generator)

    def __next__(self) -> Batch:
        picked, count = [], 0
        while count < self.batch_size:
            if self._next >= len(self._order):
                self.epoch += 1
                self._order, self._next = self._permutation(self.epoch), 0
            take = self._order[self._next:self._next + self.batch_size - count]
            self._next += len(take)
            count += len(take)
            picked.append(take)
        return as_batch(self.rows.select(torch.cat(picked)))


def in_order(rows: Rows, batch_size: int) -> Iterator[Batch]:
    """Every row once, in order, in micro-batches (the last may be short): evaluation."""
    for start in range(0, len(rows), batch_size):
        yield as_batch(rows.select(torch.arange(start, min(start + batch_size, len(rows)))))


def load_rows(spec: str | pathlib.Path, tokenizer: Tokenizer, seq_len: int, *,
              text_field: str = "text", progress: bool = False) -> Rows:
    """Read, tokenize and pack the data `spec` names (see the module docstring)."""
    return pack(read_examples(spec, text_field), tokenizer, seq_len, source=str(spec),
                progress=progress)
