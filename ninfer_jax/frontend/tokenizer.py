"""The one tokenizer interface every backend implements.

Owns the contract the rest of the Frontend relies on: `encode` (special-token text such as
`<|im_start|>` is recognised, as chat templates need), `decode`, per-token bytes for incremental
detokenization, the special-token table, EOS ids and the vocabulary size. Backends own their file
formats; nothing here knows about chat templates, stop strings or output sessions.
"""

from __future__ import annotations

import abc
import re
from collections.abc import Mapping, Sequence

# Token texts that end generation when the tokenizer has them (Qwen's chat end and document end).
DEFAULT_EOS_TOKENS = ("<|im_end|>", "<|endoftext|>")
THINK_START = "<think>"
THINK_END = "</think>"


class Tokenizer(abc.ABC):
    """Maps text to token ids and token ids back to bytes.

    `token_bytes(i)` is the exact byte string token `i` contributes to a decoded text, so a
    continuation decodes as the concatenation of its tokens' bytes (which may split a UTF-8
    character between tokens). `decode` joins those bytes and replaces invalid UTF-8 with U+FFFD.
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        special_tokens: Mapping[str, int],
        eos_tokens: Sequence[str] = DEFAULT_EOS_TOKENS,
        extra_eos_ids: Sequence[int] = (),
    ) -> None:
        self._vocab_size = vocab_size
        self._special_tokens = dict(special_tokens)
        named = {self._special_tokens[t] for t in eos_tokens if t in self._special_tokens}
        self._eos_ids = frozenset(named | set(extra_eos_ids))
        self._special_ids = frozenset(self._special_tokens.values())
        texts = sorted((t for t in self._special_tokens if t), key=len, reverse=True)
        self._special_pattern = re.compile("|".join(map(re.escape, texts))) if texts else None

    @property
    def special_pattern(self) -> re.Pattern[str] | None:
        """Matches any special-token text (longest first); None when there are none."""
        return self._special_pattern

    @property
    def vocab_size(self) -> int:
        """Number of valid token ids: every id is in [0, vocab_size)."""
        return self._vocab_size

    @property
    def special_tokens(self) -> Mapping[str, int]:
        """Added / control tokens matched as whole units in text: token text -> id."""
        return self._special_tokens

    @property
    def eos_ids(self) -> frozenset[int]:
        """Ids that end generation."""
        return self._eos_ids

    def special_id(self, text: str) -> int | None:
        """The id of special token `text`, or None when this vocabulary lacks it."""
        return self._special_tokens.get(text)

    @property
    def think_ids(self) -> tuple[int, int] | None:
        """(`<think>` id, `</think>` id) when the vocabulary has both, else None."""
        start, end = self.special_id(THINK_START), self.special_id(THINK_END)
        if start is None or end is None:
            return None
        return start, end

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token texts in it become their ids. No BOS/EOS is added."""

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` read as plain text: a special-token text in it (`<|im_end|>`,
        `<think>`) is spelled with ordinary tokens, never its control id, and decodes back to
        the same characters. Backends with an ordinary-text encoder override this."""
        if self._special_pattern is None or not self._special_pattern.search(text):
            return self.encode(text)
        ids: list[int] = []
        start = 0
        for match in self._special_pattern.finditer(text):
            ids += self.encode(text[start : match.start()])
            ids += self._spell(match.group())
            start = match.end()
        ids += self.encode(text[start:])
        return ids

    def _spell(self, special_text: str) -> list[int]:
        """Ordinary tokens for one special-token text: one character at a time, so no special
        token (all longer than one character) can match."""
        ids = [i for ch in special_text for i in self.encode(ch)]
        if self._special_ids.intersection(ids) or self.decode(ids) != special_text:
            raise ValueError(f"this tokenizer cannot spell {special_text!r} as plain text")
        return ids

    @abc.abstractmethod
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` contributes to decoded text (special tokens: their text)."""

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids` as a continuation: concatenated token bytes, invalid UTF-8 -> U+FFFD."""
        return b"".join(self.token_bytes(i) for i in token_ids).decode("utf-8", errors="replace")

    def check_id(self, token_id: int) -> None:
        """Raises IndexError when `token_id` is outside [0, vocab_size)."""
        if not 0 <= token_id < self._vocab_size:
            raise IndexError(
                f"token id {token_id} is outside the vocabulary [0, {self._vocab_size})"
            )
