"""Splitting tensors into shard files of bounded size, and the index file naming them
(Hugging Face's layout: `model-00001-of-00003.safetensors` + `model.safetensors.index.json`)."""

from __future__ import annotations

import json
from pathlib import Path


def plan_shards(sizes: dict[str, int], max_nbytes: int, stem: str,
                suffix: str) -> list[tuple[str, list[str]]]:
    """Names in order, cut into shards of at most `max_nbytes` (a larger tensor gets a shard of
    its own); one shard is called `stem + suffix`, several `stem-0000i-of-0000n + suffix`."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, nbytes in sizes.items():
        if shards[-1] and used + nbytes > max_nbytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    if len(shards) == 1:
        return [(f"{stem}{suffix}", shards[0])]
    n = len(shards)
    return [(f"{stem}-{i + 1:05d}-of-{n:05d}{suffix}", names) for i, names in enumerate(shards)]


def write_index(path: Path, shards: list[tuple[str, list[str]]], total_nbytes: int) -> None:
    """The `*.index.json` that maps each tensor to its shard file."""
    weight_map = {name: file for file, names in shards for name in names}
    path.write_text(json.dumps({"metadata": {"total_size": total_nbytes}, "weight_map": weight_map},
                               indent=2))
