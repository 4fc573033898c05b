"""Data that `datasets` reads (the optional extra `infinity[data]`): a folder written by
`save_to_disk`, .parquet / .json files, or a dataset id already in the local cache (never
downloaded: the run stays offline). Each yields its records (dicts) one by one.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator
from typing import Any

from infinity.errors import InputError, described

SUFFIXES = {".parquet": "parquet", ".json": "json"}  # file suffix -> datasets builder
SPLIT = "train"


def _datasets(what: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise InputError(f"--data {what}: reading it needs the datasets package "
                         "(pip install 'infinity[data]')") from None
    return datasets


def is_saved_dataset(path: pathlib.Path) -> bool:
    """A folder `Dataset.save_to_disk` (or `DatasetDict.save_to_disk`) wrote."""
    return path.is_dir() and ((path / "dataset_dict.json").is_file()
                              or (path / "state.json").is_file()
                              and (path / "dataset_info.json").is_file())


def _one_split(data: Any, what: str) -> Any:
    """The "train" split of a DatasetDict (or its only one); a Dataset as it is."""
    if not hasattr(data, "keys"):
        return data
    splits = list(data.keys())
    if SPLIT in splits or len(splits) == 1:
        return data[SPLIT if SPLIT in splits else splits[0]]
    raise InputError(f"--data {what}: splits {', '.join(splits)} and none is "
                     f"{SPLIT!r}")


def read_saved(path: pathlib.Path) -> Iterator[dict[str, Any]]:
    datasets = _datasets(str(path))
    try:
        data = datasets.load_from_disk(str(path))
    except (OSError, ValueError) as e:
        raise InputError(f"--data {path}: not a readable datasets folder ({e})") from None
    yield from _one_split(data, str(path))


def read_file(path: pathlib.Path) -> Iterator[dict[str, Any]]:
    """The records of a .parquet or .json file."""
    datasets = _datasets(str(path))
    builder = SUFFIXES[path.suffix]
    try:
        data = datasets.load_dataset(builder, data_files=[str(path)], split=SPLIT)
    except Exception as e:  # pyarrow and datasets raise many kinds
        raise InputError(f"--data {path}: cannot read it as {builder} ({described(e)})"
                         ) from None
    yield from data


def looks_like_id(text: str) -> bool:
    """'name' or 'owner/name' (what the Hub calls a dataset), not a path that exists."""
    parts = text.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not text.startswith((".", "~")) \
        and not os.path.exists(text)


def _load_cached(dataset_id: str) -> Any:
    """The "train" split of a Hub dataset already in the local cache, read offline."""
    datasets = _datasets(dataset_id)
    from datasets import config as datasets_config

    saved = datasets_config.HF_HUB_OFFLINE, datasets_config.HF_DATASETS_OFFLINE
    verbosity = datasets.logging.get_verbosity()
    datasets_config.HF_HUB_OFFLINE = datasets_config.HF_DATASETS_OFFLINE = True
    datasets.logging.set_verbosity_error()  # not its "using the cached version": we asked so
    try:
        data = datasets.load_dataset(dataset_id)
    except Exception as e:  # offline misses, hub errors
        raise InputError(f"--data {dataset_id}: no such file or directory, nor a dataset in the "
                         f"local datasets cache ({type(e).__name__}); download it first "
                         "(datasets.load_dataset) or give a path") from None
    finally:
        datasets_config.HF_HUB_OFFLINE, datasets_config.HF_DATASETS_OFFLINE = saved
        datasets.logging.set_verbosity(verbosity)
    return _one_split(data, dataset_id)


def read_cached(dataset_id: str) -> Iterator[dict[str, Any]]:
    yield from _load_cached(dataset_id)


def cached_fingerprint(dataset_id: str) -> str:
    """The datasets library's fingerprint of the cached dataset (changes with its files)."""
    return _load_cached(dataset_id)._fingerprint
