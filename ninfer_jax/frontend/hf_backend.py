"""HF `tokenizers` backend: a byte-level BPE `tokenizer.json` behind the `Tokenizer` interface.

Owns reading `tokenizer.json` with the `tokenizers` library and mapping its byte-level token
strings (GPT-2's printable stand-ins for bytes) back to raw bytes. Only byte-level decoders are
supported; a sentencepiece-style `tokenizer.json` should be loaded from its `.model` file instead.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

import tokenizers

from ninfer_jax.frontend.tokenizer import DEFAULT_EOS_TOKENS, Tokenizer


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's bytes_to_unicode table inverted: printable stand-in character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class HfTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` with a ByteLevel decoder; encoding adds no BOS/EOS."""

    def __init__(
        self, tokenizer_file: str | pathlib.Path, eos_tokens: Sequence[str] = DEFAULT_EOS_TOKENS
    ) -> None:
        self._tok = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        if decoder.get("type") != "ByteLevel":
            raise ValueError(
                f"{tokenizer_file}: decoder {decoder.get('type')!r} is not supported, only "
                "ByteLevel; load a sentencepiece model from its .model file"
            )
        added = {i: t.content for i, t in self._tok.get_added_tokens_decoder().items()}
        vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        alphabet = _byte_level_alphabet()
        self._id_to_bytes: list[bytes] = []
        for token_id in range(vocab_size):
            if token_id in added:
                self._id_to_bytes.append(added[token_id].encode("utf-8"))
                continue
            token = self._tok.id_to_token(token_id)
            if token is None:
                raise ValueError(f"{tokenizer_file}: token id {token_id} has no token")
            self._id_to_bytes.append(bytes(alphabet[c] for c in token))
        specials = {text: i for i, text in added.items()}
        super().__init__(vocab_size=vocab_size, special_tokens=specials, eos_tokens=eos_tokens)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def token_bytes(self, token_id: int) -> bytes:
        self.check_id(token_id)
        return self._id_to_bytes[token_id]
