"""Chat data: a conversation (`"messages"`: a list of {"role", "content"}) rendered with the
tokenizer's chat template, and which of its tokens are trained: the assistant turns only (the
prompt is context, as TRL's SFT trainer does with `assistant_only_loss`).

Each assistant turn is found by rendering the conversation up to it twice: with the generation
prompt (what the model is given) and with the turn itself; the text between the two is the
turn, including whatever the template closes it with (an end-of-turn token), so the model
learns to stop. The rendered conversation is tokenized piece by piece (prompt, turn, prompt,
...) so every token belongs to exactly one piece. A conversation read from --data carries where
it was read (`data.jsonl:17`), so a template that fails on it names that line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from infinity.errors import InputError, described

ROLES = ("system", "user", "assistant", "tool")


class Conversation(list):
    """A record's messages (a list of {"role", "content"}) and `where` it was read."""

    def __init__(self, messages: list[dict[str, str]], where: str) -> None:
        super().__init__(messages)
        self.where = where


def check_messages(messages: Any, where: str) -> Conversation:
    """`messages` as a list of {"role", "content"} with known roles and string content."""
    if not isinstance(messages, list) or not messages:
        raise InputError(f"--data {where}: \"messages\" is not a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES \
                or not isinstance(m.get("content"), str):
            raise InputError(f"--data {where}: message {i} is not {{\"role\": one of "
                             f"{', '.join(ROLES)}, \"content\": a string}}")
    if not any(m["role"] == "assistant" for m in messages):
        raise InputError(f"--data {where}: no assistant message (nothing to train on)")
    if messages[0]["role"] == "assistant":  # a template renders no prompt from no messages
        raise InputError(f"--data {where}: message 0 is the assistant's: nothing prompts it "
                         "(start with a system or user message)")
    return Conversation(messages, where)


def _render(tokenizer: Any, messages: Sequence[dict[str, str]], prompt: bool, where: str) -> str:
    if not messages and not prompt:
        return ""
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False,
                                             add_generation_prompt=prompt)
    except Exception as e:  # the template is the user's code: jinja2 and Python errors alike
        raise InputError(f"--data {where}: the chat template fails on this conversation "
                         f"({described(e)})") from None


def has_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def tokenize_chat(tokenizer: Any, messages: Sequence[dict[str, str]], where: str
                  ) -> tuple[list[int], list[bool]]:
    """(token ids of the rendered conversation, for each whether it is trained). Errors name
    the conversation's own `where` if it is a Conversation, else `where` (the --data source)."""
    where = messages.where if isinstance(messages, Conversation) else where
    if not has_template(tokenizer):
        raise InputError(f"--data {where}: chat messages need a tokenizer with a chat template, "
                         "and this one has none (give --model a tokenizer_config.json with "
                         "\"chat_template\", or use text data)")
    whole = _render(tokenizer, messages, False, where)
    pieces: list[tuple[str, bool]] = []
    done = 0  # characters of `whole` already in pieces
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], True, where)
        through = _render(tokenizer, messages[:i + 1], False, where)
        if not (through.startswith(before) and whole.startswith(through)) or len(before) < done:
            raise InputError(f"--data {where}: the chat template does not render this "
                             "conversation turn by turn (a prefix of it renders differently), "
                             "so its assistant turns cannot be told apart")
        pieces += [(whole[done:len(before)], False), (whole[len(before):len(through)], True)]
        done = len(through)
    pieces.append((whole[done:], False))
    ids: list[int] = []
    trained: list[bool] = []
    for text, is_turn in pieces:
        if text:
            piece = tokenizer.encode(text, add_special_tokens=False)
            ids += piece
            trained += [is_turn] * len(piece)
    return ids, trained
