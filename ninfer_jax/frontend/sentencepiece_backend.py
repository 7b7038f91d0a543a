"""SentencePiece backend: a `.model` file behind the `Tokenizer` interface.

Owns the mapping from sentencepiece pieces to bytes: `▁` is a space, byte-fallback pieces
`<0xAB>` are single bytes (so a character may be split across tokens), control pieces such as
`<s>` contribute nothing, user-defined symbols (`<|im_end|>`, `<think>`, ...) are special tokens
that contribute their text. The piece types come from the model proto, read here with a minimal
protobuf wire-format reader so no protobuf package is needed.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator, Sequence

import sentencepiece

from ninfer_jax.frontend.tokenizer import Tokenizer

# sentencepiece_model.proto: ModelProto.pieces = 1; SentencePiece {piece = 1; type = 3}.
_TYPE_NORMAL, _TYPE_UNKNOWN, _TYPE_CONTROL, _TYPE_USER_DEFINED, _TYPE_BYTE = 1, 2, 3, 4, 6
_UNKNOWN_TEXT = " \u2047 "  # what sentencepiece itself decodes an unknown piece to


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7


def _fields(data: bytes) -> Iterator[tuple[int, int, bytes | int]]:
    """(field number, wire type, value) of one protobuf message; skips fixed-width values."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(data, pos)
            yield number, wire, value
        elif wire == 2:
            size, pos = _varint(data, pos)
            yield number, wire, data[pos : pos + size]
            pos += size
        elif wire in (1, 5):
            pos += 8 if wire == 1 else 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire} in sentencepiece model")


def _piece_types(model_proto: bytes) -> list[int]:
    """The type of every piece, in id order."""
    types = []
    for number, wire, value in _fields(model_proto):
        if number == 1 and wire == 2:
            piece_type = _TYPE_NORMAL
            for sub_number, sub_wire, sub_value in _fields(value):
                if sub_number == 3 and sub_wire == 0:
                    piece_type = sub_value
            types.append(piece_type)
    return types


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model; `encode` adds no BOS/EOS, `decode` drops a dummy-prefix space."""

    def __init__(self, model_file: str | pathlib.Path) -> None:
        proto = pathlib.Path(model_file).read_bytes()
        self._sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
        types = _piece_types(proto)
        if len(types) != self._sp.get_piece_size():
            raise ValueError(f"{model_file}: could not read the piece types of the model")
        self._id_to_bytes = [self._bytes_of(i, t) for i, t in enumerate(types)]
        specials = {
            self._sp.id_to_piece(i): i
            for i, t in enumerate(types)
            if t in (_TYPE_CONTROL, _TYPE_USER_DEFINED)
        }
        eos = [self._sp.eos_id()] if self._sp.eos_id() >= 0 else []
        super().__init__(vocab_size=len(types), special_tokens=specials, extra_eos_ids=eos)
        probe = self._sp.encode("a", out_type=str)
        self._adds_dummy_prefix = bool(probe) and probe[0].startswith("\u2581")
        self._byte_ids = {self._id_to_bytes[i][0]: i for i, t in enumerate(types)
                          if t == _TYPE_BYTE}

    def _bytes_of(self, token_id: int, piece_type: int) -> bytes:
        piece = self._sp.id_to_piece(token_id)
        if piece_type == _TYPE_BYTE:
            return bytes([int(piece[3:5], 16)])
        if piece_type == _TYPE_CONTROL:
            return b""
        if piece_type == _TYPE_UNKNOWN:
            return _UNKNOWN_TEXT.encode("utf-8")
        return piece.replace("\u2581", " ").encode("utf-8")

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_text(self, text: str) -> list[int]:
        if self._adds_dummy_prefix and self.special_pattern is not None \
                and self.special_pattern.search(text):
            # Encoding the pieces around a spelled special token apart would add a dummy-prefix
            # space to each: refuse rather than change the text.
            raise ValueError("this sentencepiece model adds a dummy prefix; special-token text "
                             "inside content cannot be spelled as plain text")
        return super().encode_text(text)

    def _spell(self, special_text: str) -> list[int]:
        """Byte-fallback pieces for each byte of the text, when the model has them."""
        raw = special_text.encode("utf-8")
        if all(b in self._byte_ids for b in raw):
            return [self._byte_ids[b] for b in raw]
        return super()._spell(special_text)

    def token_bytes(self, token_id: int) -> bytes:
        self.check_id(token_id)
        return self._id_to_bytes[token_id]

    def decode(self, token_ids: Sequence[int]) -> str:
        """Whole-text decode: as `Tokenizer.decode`, minus the space a dummy prefix put first."""
        text = super().decode(token_ids)
        if self._adds_dummy_prefix and text.startswith(" "):
            return text[1:]
        return text
