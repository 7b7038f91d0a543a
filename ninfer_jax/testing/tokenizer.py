"""ByteTokenizer: a byte-level test tokenizer (ids 0..255 are bytes) with the chat control tokens.

Ids past the control tokens (when `vocab_size` asks for more, to match a test model's
vocabulary) decode as `<N>`, so any model output is printable.
"""

from __future__ import annotations

from ninfer_jax.frontend.tokenizer import Tokenizer

CONTROL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>")


class ByteTokenizer(Tokenizer):
    def __init__(self, vocab_size: int = 256 + len(CONTROL)) -> None:
        if vocab_size < 256 + len(CONTROL):
            raise ValueError(f"vocab_size must be >= {256 + len(CONTROL)}, got {vocab_size}")
        specials = {t: 256 + i for i, t in enumerate(CONTROL)}
        super().__init__(vocab_size=vocab_size, special_tokens=specials)
        self._by_id = {i: t for t, i in specials.items()}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            for token, tid in self.special_tokens.items():
                if text.startswith(token, i):
                    ids.append(tid)
                    i += len(token)
                    break
            else:
                ids.extend(text[i].encode("utf-8"))
                i += 1
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        self.check_id(token_id)
        if token_id < 256:
            return bytes([token_id])
        return self._by_id.get(token_id, f"<{token_id}>").encode()
