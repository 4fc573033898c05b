"""The byte-level tokenizer: token i is byte value i (0-255), then <s>, </s> and <pad>. The
built-in model of `infinity-train` and the models `infinity-make-model` writes are made for
these ids, so they are named here once and every model config takes them from here."""

from __future__ import annotations

from typing import Any

BYTE_TOKENS = 256  # tokens 0-255: the byte values
BYTE_BOS_ID = BYTE_TOKENS  # <s>
BYTE_EOS_ID = BYTE_TOKENS + 1  # </s>
BYTE_PAD_ID = BYTE_TOKENS + 2  # <pad>
BYTE_VOCAB_SIZE = BYTE_TOKENS + 3  # the least vocab_size of a model for these tokens


def byte_config_ids() -> dict[str, int]:
    """The special token ids of a model config (e.g. `LlamaConfig(**byte_config_ids())`) that
    match `byte_tokenizer()`."""
    return {"bos_token_id": BYTE_BOS_ID, "eos_token_id": BYTE_EOS_ID, "pad_token_id": BYTE_PAD_ID}


def byte_tokenizer() -> Any:
    """A `transformers` fast tokenizer whose token ids are the UTF-8 byte values, plus `<s>`,
    `</s>` and `<pad>` (`BYTE_BOS_ID`, `BYTE_EOS_ID`, `BYTE_PAD_ID`), made from scratch
    (nothing downloaded). `save_pretrained` it next to a model so `AutoTokenizer` loads it
    from the directory."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(_byte_level_chars())}
    vocab |= {"<s>": BYTE_BOS_ID, "</s>": BYTE_EOS_ID, "<pad>": BYTE_PAD_ID}
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
