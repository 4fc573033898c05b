"""The tokenized data of a run, cached next to it (`<output>/cache/tokens-<key>.safetensors`),
so a --resume does not tokenize again.

The key is a hash of what the rows depend on: the data (each file's path, size and
modification time; a cached dataset's fingerprint), the tokenizer (its vocabulary and rules,
special tokens and chat template), --seq-len and --text-field. A file whose recorded key or
shapes do not match is ignored (and replaced), never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from infinity.train import sources
from infinity.train.data import Rows, data_files

logger = logging.getLogger(__name__)

SUBDIR = "cache"
FORMAT = 1


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of everything that decides the tokenizer's ids."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    rules = backend.to_str() if backend is not None else \
        json.dumps(sorted(tokenizer.get_vocab().items()))
    extra = [type(tokenizer).__name__, tokenizer.bos_token_id, tokenizer.eos_token_id,
             getattr(tokenizer, "chat_template", None)]
    return hashlib.sha256((rules + json.dumps(extra, default=str)).encode()).hexdigest()


def files_fingerprint(paths: list[pathlib.Path]) -> list[tuple[str, int, int]]:
    """(path, size, mtime in ns) of each file: what a change of the data changes."""
    stats = []
    for path in paths:
        st = path.stat()
        stats.append((str(path.resolve()), st.st_size, st.st_mtime_ns))
    return stats


def text_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def data_fingerprint(spec: str) -> Any:
    """What --data's rows depend on: its files' stats (a datasets folder: every file in it),
    or a cached dataset's fingerprint."""
    path = pathlib.Path(spec)
    if sources.is_saved_dataset(path):
        return files_fingerprint(sorted(p for p in path.rglob("*") if p.is_file()))
    if not path.exists() and sources.looks_like_id(spec):
        return ["dataset", spec, sources.cached_fingerprint(spec)]
    return files_fingerprint(data_files(path))


def key(data: Any, tokenizer: Any, seq_len: int, text_field: str) -> str:
    """The cache key of rows made from `data` (a JSON-able fingerprint of the data)."""
    parts = {"format": FORMAT, "data": data, "tokenizer": tokenizer_fingerprint(tokenizer),
             "seq_len": seq_len, "text_field": text_field}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def path(run_dir: pathlib.Path, cache_key: str) -> pathlib.Path:
    return run_dir / SUBDIR / f"tokens-{cache_key[:32]}.safetensors"


def load(run_dir: pathlib.Path, cache_key: str, seq_len: int) -> Rows | None:
    """The cached rows of `cache_key`, or None (absent, another key, or not a cache file)."""
    file = path(run_dir, cache_key)
    if not file.is_file():
        return None
    try:
        with safe_open(file, "pt") as f:
            if (f.metadata() or {}).get("key") != cache_key:
                return None
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (OSError, ValueError, SafetensorError) as e:
        logger.warning("tokenized data cache %s unreadable (%s): tokenizing again", file, e)
        return None
    ids, trained = tensors.get("ids"), tensors.get("trained")
    if ids is None or ids.dtype != torch.int32 or ids.dim() != 2 or ids.shape[1] != seq_len \
            or trained is not None and (trained.dtype != torch.bool or trained.shape != ids.shape):
        return None
    logger.info("tokenized data from %s (%d rows)", file, len(ids))
    return Rows(ids, trained)


def save(run_dir: pathlib.Path, cache_key: str, rows: Rows) -> pathlib.Path:
    """Write the rows under their key (written aside and renamed: never half a file, and no
    partial one left behind when the write fails, e.g. a full disk under a --resume, which
    writes in --output itself)."""
    file = path(run_dir, cache_key)
    file.parent.mkdir(parents=True, exist_ok=True)
    tensors = {"ids": rows.ids.contiguous()}
    if rows.trained is not None:
        tensors["trained"] = rows.trained.contiguous()
    partial = file.with_name(file.name + f".partial-{os.getpid()}")
    try:
        save_file(tensors, str(partial), metadata={"key": cache_key})
        os.replace(partial, file)
    finally:
        partial.unlink(missing_ok=True)
    return file
