"""Qwen3.5 / Qwen3.6 byte-level BPE, implemented from the tiktoken rank file.

Owns the tokenizer directory format `qwen3_5.tiktoken` (base64 token bytes + rank per line) plus
`special_tokens.json` (added tokens, the pre-tokenizer regex with `\\p{M}`, the NFC normalizer).
Encoding: split out special tokens, NFC-normalize the rest, pre-tokenize with the split regex,
then merge each piece's bytes greedily by lowest rank (a token's id is its rank). Pieces are
cached because natural text repeats them constantly.
"""

from __future__ import annotations

import base64
import json
import pathlib
import unicodedata

import regex

from ninfer_jax.frontend.tokenizer import Tokenizer

RANKS_FILE = "qwen3_5.tiktoken"
SPECIAL_TOKENS_FILE = "special_tokens.json"
_MAX_CACHED_PIECES = 200_000


def _load_ranks(path: pathlib.Path) -> list[bytes]:
    """Token bytes indexed by rank; the file must list ranks 0..n-1 in order."""
    token_bytes: list[bytes] = []
    for line_no, line in enumerate(path.read_bytes().splitlines()):
        if not line:
            continue
        encoded, rank = line.split()
        if int(rank) != len(token_bytes):
            raise ValueError(f"{path}:{line_no + 1}: rank {int(rank)}, expected {len(token_bytes)}")
        token_bytes.append(base64.b64decode(encoded))
    return token_bytes


def _merge(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    """Byte-pair merge of one pre-token piece: repeatedly join the adjacent pair of lowest rank."""
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best_rank, best_at = None, 0
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_at = rank, i
        if best_rank is None:
            break
        parts[best_at : best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return [ranks[p] for p in parts]


class QwenBpeTokenizer(Tokenizer):
    """Byte-level BPE over `n_bpe_tokens` ranks followed by the added special tokens."""

    def __init__(self, directory: str | pathlib.Path) -> None:
        directory = pathlib.Path(directory)
        config = json.loads((directory / SPECIAL_TOKENS_FILE).read_text())
        if config.get("normalizer", "NFC") != "NFC":
            raise ValueError(f"{directory / SPECIAL_TOKENS_FILE}: only the NFC normalizer is known")
        self._id_to_bytes = _load_ranks(directory / config.get("bpe_ranks_file", RANKS_FILE))
        if len(self._id_to_bytes) != config["n_bpe_tokens"]:
            raise ValueError(
                f"{directory}: {len(self._id_to_bytes)} ranks, expected {config['n_bpe_tokens']}"
            )
        self._ranks = {b: i for i, b in enumerate(self._id_to_bytes)}
        specials: dict[str, int] = config["special_tokens"]
        for text, token_id in sorted(specials.items(), key=lambda kv: kv[1]):
            if token_id != len(self._id_to_bytes):
                raise ValueError(f"special token {text!r} has id {token_id}, expected contiguous")
            self._id_to_bytes.append(text.encode("utf-8"))
        super().__init__(vocab_size=len(self._id_to_bytes), special_tokens=specials)
        self._pretokenize = regex.compile(config["pretokenize_regex"])
        longest_first = sorted(specials, key=len, reverse=True)
        self._special_split = regex.compile("|".join(regex.escape(t) for t in longest_first))
        self._cache: dict[str, tuple[int, ...]] = {}

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        start = 0
        for match in self._special_split.finditer(text):
            self._encode_ordinary(text[start : match.start()], ids)
            ids.append(self._special_tokens[match.group()])
            start = match.end()
        self._encode_ordinary(text[start:], ids)
        return ids

    def encode_text(self, text: str) -> list[int]:
        """Ordinary BPE over the whole text: special-token texts are merged like any text."""
        ids: list[int] = []
        self._encode_ordinary(text, ids)
        return ids

    def _encode_ordinary(self, text: str, out: list[int]) -> None:
        if not text:
            return
        for piece in self._pretokenize.findall(unicodedata.normalize("NFC", text)):
            cached = self._cache.get(piece)
            if cached is None:
                raw = piece.encode("utf-8")
                single = self._ranks.get(raw)
                cached = (single,) if single is not None else tuple(_merge(raw, self._ranks))
                if len(self._cache) >= _MAX_CACHED_PIECES:
                    self._cache.clear()
                self._cache[piece] = cached
            out.extend(cached)

    def token_bytes(self, token_id: int) -> bytes:
        self.check_id(token_id)
        return self._id_to_bytes[token_id]
