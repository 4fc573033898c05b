"""A randomly initialised Hugging Face model directory of any size, for benchmarks and tests
where no real weights are at hand: config.json, safetensors shards written tensor by tensor
(the model never exists whole in memory: it is built on the meta device for its names and
shapes), and a byte-level tokenizer that `AutoTokenizer` loads from the directory.
"""

from __future__ import annotations

import errno
import logging
import os
import pathlib
import shutil
from collections.abc import Iterator
from typing import Any

import torch

from infinity.models._byte_tokenizer import byte_tokenizer
from infinity.models._writer import Spec, write_shards
from infinity.zero import parameters_on_meta

logger = logging.getLogger(__name__)


def write_random_model(directory: str | os.PathLike[str], config: Any, *,
                       dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                       max_shard_bytes: int = 2 << 30) -> int:
    """Write a `transformers` model of `config` (a PretrainedConfig, e.g. LlamaConfig) with
    random weights into `directory` (must not exist; made complete or not at all); returns its
    parameter count. Matrices and embeddings are normal(0, config.initializer_range), norm
    weights one, biases zero, as `transformers` initialises them; peak memory is one tensor."""
    import transformers

    target = pathlib.Path(directory)
    if target.exists():
        raise FileExistsError(errno.EEXIST,
                              "exists (a new model directory is written, never over another)",
                              str(target))
    with parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    specs = [(name, p.shape, dtype) for name, p in model.named_parameters()]  # a tied weight once
    std = getattr(config, "initializer_range", 0.02)
    staging = target.parent / f".{target.name}.partial-{os.getpid()}"
    staging.mkdir(parents=True)
    try:
        write_shards(staging, specs, _random_tensors(specs, std, seed),
                     max_shard_bytes=max_shard_bytes)
        model.config.architectures = [type(model).__name__]
        model.config.dtype = dtype
        model.config.save_pretrained(staging)
        byte_tokenizer().save_pretrained(staging)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    count = sum(p.numel() for p in model.parameters())
    logger.info("models: wrote %s, %d parameters in %s", target, count, dtype)
    return count


def _random_tensors(specs: list[Spec], std: float, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    for name, shape, dtype in specs:
        if len(shape) >= 2:
            values = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        elif name.endswith("bias"):
            values = torch.zeros(shape)
        else:  # the weight of a norm
            values = torch.ones(shape)
        yield name, values.to(dtype)
