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

from infinity.models._writer import Spec, write_shards
from infinity.zero import parameters_on_meta

logger = logging.getLogger(__name__)

BYTE_TOKENS = 256  # the byte-level tokenizer: token i is byte value i, then <s>, </s>, <pad>


def byte_tokenizer() -> Any:
    """A `transformers` fast tokenizer whose token ids are the UTF-8 byte values (0-255), plus
    `<s>` (256), `</s>` (257) and `<pad>` (258), made from scratch (nothing downloaded); the
    built-in model of `infinity-train` is trained on these ids. `save_pretrained` it next to a
    model so `AutoTokenizer` loads it from the directory."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(_byte_level_chars())}
    vocab |= {"<s>": BYTE_TOKENS, "</s>": BYTE_TOKENS + 1, "<pad>": BYTE_TOKENS + 2}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>",
                                                eos_token="</s>", pad_token="<pad>",
                                                split_special_tokens=True)


def _byte_level_chars() -> list[str]:
    """The character the ByteLevel pre-tokenizer writes for each byte value (GPT-2's table:
    printable Latin-1 bytes stand for themselves, the rest take code points from 256 up)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)}
    spare = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(spare)) for b in range(BYTE_TOKENS)]


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
