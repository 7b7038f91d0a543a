"""PreparedPrompt: the token ids a request starts from, and `prepare`, which builds one.

Owns input validation for the three ways a prompt arrives (text, chat messages, token ids), each
error naming the offending field, and the prompt's content identity: a sha256 over the ids as
little-endian uint32, the key prefix lookup uses. It does not know context limits or budgets;
the Engine checks those.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ninfer_jax.frontend.chat_template import ChatTemplate
from ninfer_jax.frontend.tokenizer import Tokenizer


class PromptError(ValueError):
    """Bad prompt input; `field` names the request field at fault (e.g. `prompt_token_ids[3]`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def token_digest(token_ids: Sequence[int]) -> str:
    """Hex sha256 of `token_ids` encoded as little-endian uint32."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<u4").tobytes()).hexdigest()


@dataclasses.dataclass(frozen=True)
class PreparedPrompt:
    """A validated prompt, immutable.

    token_ids: the prompt tokens, every id inside the tokenizer's vocabulary.
    text: the text that was tokenized (rendered chat or raw prompt); None for given token ids.
    media: images/videos referenced by placeholder tokens; empty for text-only prompts.
    digest: hex sha256 over token_ids (see `token_digest`), computed here.
    """

    token_ids: tuple[int, ...]
    text: str | None = None
    media: tuple[Any, ...] = ()
    digest: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", token_digest(self.token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _checked_ids(token_ids: Any, vocab_size: int) -> tuple[int, ...]:
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, (Sequence, np.ndarray)):
        raise PromptError("prompt_token_ids", f"expected a sequence of ints, got {type(token_ids)}")
    if len(token_ids) == 0:
        raise PromptError("prompt_token_ids", "must not be empty")
    checked = []
    for i, token_id in enumerate(token_ids):
        if isinstance(token_id, (bool, np.bool_)) or not isinstance(token_id, (int, np.integer)):
            raise PromptError(
                f"prompt_token_ids[{i}]", f"expected an int, got {type(token_id).__name__}"
            )
        if not 0 <= token_id < vocab_size:
            raise PromptError(
                f"prompt_token_ids[{i}]", f"{token_id} is outside the vocabulary [0, {vocab_size})"
            )
        checked.append(int(token_id))
    return tuple(checked)


def _check_messages(messages: Any) -> list[Mapping[str, Any]]:
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise PromptError("messages", f"expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise PromptError("messages", "must not be empty")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise PromptError(f"messages[{i}]", f"expected a mapping, got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise PromptError(f"messages[{i}].role", "must be a string")
    return list(messages)


def prepare(
    tokenizer: Tokenizer,
    *,
    prompt: str | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    chat_template: ChatTemplate | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> PreparedPrompt:
    """A PreparedPrompt from exactly one of `prompt`, `messages` (rendered with `chat_template`)
    or `prompt_token_ids`. Raises PromptError naming the field for bad input."""
    given = [
        name
        for name, value in (
            ("prompt", prompt),
            ("messages", messages),
            ("prompt_token_ids", prompt_token_ids),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise PromptError(
            "prompt",
            f"exactly one of prompt, messages, prompt_token_ids must be given; got {given or 'none'}",
        )
    if prompt_token_ids is not None:
        return PreparedPrompt(_checked_ids(prompt_token_ids, tokenizer.vocab_size))
    if messages is not None:
        checked = _check_messages(messages)
        if chat_template is None:
            raise PromptError("messages", "this model has no chat template; pass prompt instead")
        text = chat_template.render(
            checked,
            add_generation_prompt=add_generation_prompt,
            enable_thinking=enable_thinking,
            tools=tools,
        )
    else:
        if not isinstance(prompt, str):
            raise PromptError("prompt", f"expected a string, got {type(prompt).__name__}")
        text = prompt
    if not text:
        raise PromptError(given[0], "must not be empty")
    token_ids = tokenizer.encode(text)
    if not token_ids:
        raise PromptError(given[0], "encodes to no tokens")
    return PreparedPrompt(tuple(token_ids), text=text)
