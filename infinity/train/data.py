"""Training text: read .txt / .jsonl files (or a directory of them), tokenize, pack into
fixed-length sequences, and serve micro-batches in a seed-stable shuffled order.

Packing concatenates the documents (each as bos + tokens + eos where the tokenizer has them) and
cuts the stream into rows of `seq_len` tokens; the tail shorter than a row is dropped. Every
epoch is a permutation of the rows drawn from `seed + epoch`, so a run is reproducible.
"""

from __future__ import annotations

import json
import logging
import pathlib
import re
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

from infinity.errors import InputError

logger = logging.getLogger(__name__)

SUFFIXES = (".txt", ".jsonl")
_ESCAPED = re.compile("[\udc80-\udcff]")  # bytes surrogateescape could not decode


class Tokenizer(Protocol):
    bos_token_id: int | None
    eos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def data_files(path: str | pathlib.Path) -> list[pathlib.Path]:
    """The .txt and .jsonl files `path` names: itself, or those under it (sorted, recursive)."""
    path = pathlib.Path(path)
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in SUFFIXES)
        if not files:
            raise InputError(f"--data {path}: no .txt or .jsonl file in this directory")
        return files
    if not path.exists():
        raise InputError(f"--data {path}: no such file or directory")
    if path.suffix not in SUFFIXES:
        raise InputError(f"--data {path}: not a .txt or .jsonl file (or a directory of them)")
    if not path.is_file():  # a FIFO or device would block or never end
        raise InputError(f"--data {path}: not a regular file")
    return [path]


def _decode(raw: bytes, replaced: list[int]) -> str:
    """`raw` as UTF-8, each invalid byte replaced by U+FFFD and counted in replaced[0]
    (surrogateescape turns each into one lone surrogate, which valid UTF-8 never gives)."""
    text, count = _ESCAPED.subn("\ufffd", raw.decode("utf-8", errors="surrogateescape"))
    replaced[0] += count
    return text


def read_documents(files: Sequence[pathlib.Path]) -> Iterator[str]:
    """Each .txt file is one document; each line of a .jsonl file is one (its "text" field).
    Bytes that are not UTF-8 become U+FFFD, and a warning says how many there were."""
    for path in files:
        replaced = [0]
        yield from _documents(path, replaced)
        if replaced[0]:
            logger.warning("--data %s: %d bytes are not UTF-8; each was read as U+FFFD", path,
                           replaced[0])


def _documents(path: pathlib.Path, replaced: list[int]) -> Iterator[str]:
    if path.suffix == ".txt":
        yield _decode(path.read_bytes(), replaced)
        return
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
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise InputError(f"--data {path}:{number}: no string field \"text\"")
            yield text


def pack(documents: Iterator[str], tokenizer: Tokenizer, seq_len: int, *, source: str) -> torch.Tensor:
    """[rows, seq_len] int32 token ids (4 bytes a token; batches come out as int64); InputError
    when the text fills not even one row."""
    bos = [] if tokenizer.bos_token_id is None else [tokenizer.bos_token_id]
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    pieces = [torch.tensor(bos + tokenizer.encode(text, add_special_tokens=False) + eos, dtype=torch.int32)
              for text in documents if text.strip()]
    tokens = sum(len(p) for p in pieces)
    rows = tokens // seq_len
    if rows == 0:
        raise InputError(f"--data {source}: {tokens} tokens of text, not enough for one "
                         f"sequence of --seq-len {seq_len}" if tokens else f"--data {source}: no text")
    return torch.cat(pieces)[:rows * seq_len].view(rows, seq_len)


class Batches:
    """Micro-batches (int64 [batch_size, seq_len]) of packed rows, a fresh seeded permutation
    each epoch (endless)."""

    def __init__(self, rows: torch.Tensor, batch_size: int, seed: int = 0) -> None:
        if batch_size < 1:
            raise InputError(f"--batch-size {batch_size}: must be at least 1")
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        self.epoch, self._order, self._next = -1, torch.empty(0, dtype=torch.int64), 0

    def __iter__(self) -> Iterator[torch.Tensor]:
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

    def __next__(self) -> torch.Tensor:
        picked, count = [], 0
        while count < self.batch_size:
            if self._next >= len(self._order):
                self.epoch += 1
                self._order, self._next = self._permutation(self.epoch), 0
            take = self._order[self._next:self._next + self.batch_size - count]
            self._next += len(take)
            count += len(take)
            picked.append(take)
        return self.rows[torch.cat(picked)].to(torch.int64)


def load_rows(path: str | pathlib.Path, tokenizer: Tokenizer, seq_len: int) -> torch.Tensor:
    """Read, tokenize and pack the data at `path` (see the module docstring)."""
    return pack(read_documents(data_files(path)), tokenizer, seq_len, source=str(path))
