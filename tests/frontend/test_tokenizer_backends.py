"""Tokenizer backends: Qwen3.5 goldens, round trips on TinyStories / WikiText, backend choice."""

from __future__ import annotations

import json
import time
import unicodedata

import pytest
import sentencepiece

from ninfer_jax.frontend import (
    HfTokenizer,
    QwenBpeTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    load_tokenizer,
)


def _corpus_lines(shared_data, count: int = 300) -> list[str]:
    stories = (shared_data / "tinystories" / "train_head_cased.txt").read_text().split("\n")
    wiki = (shared_data / "wikitext-2-raw" / "wiki.test.raw").read_text().split("\n")
    return [line for line in stories[-count:] + wiki[:count] if line]


def _assert_bytes_consistent(tok: Tokenizer, ids: list[int]) -> None:
    joined = b"".join(tok.token_bytes(i) for i in ids).decode("utf-8", errors="replace")
    assert Tokenizer.decode(tok, ids) == joined


def test_qwen_goldens(qwen_dir, qwen):
    cases = json.loads((qwen_dir / "goldens.json").read_text())["cases"]
    assert len(cases) == 5
    for case in cases:
        assert qwen.encode(case["text"]) == case["ids"], case["text"]
        assert qwen.decode(case["ids"]) == case["text"]


def test_qwen_loads_fast_and_has_the_specials(qwen_dir):
    start = time.perf_counter()
    tok = QwenBpeTokenizer(qwen_dir)
    assert time.perf_counter() - start < 2.0
    assert tok.vocab_size == 248_077
    assert tok.special_id("<|im_end|>") == 248_046
    assert tok.think_ids == (248_068, 248_069)
    assert tok.eos_ids == frozenset({248_044, 248_046})
    with pytest.raises(IndexError, match="248077"):
        tok.token_bytes(248_077)


def test_qwen_normalizes_nfc_and_splits_marks(qwen):
    decomposed = "Cafe\u0301 e\u0301te\u0301"
    assert qwen.encode(decomposed) == qwen.encode(unicodedata.normalize("NFC", decomposed))
    # \p{M} joins letter pieces: a combining mark NFC cannot compose stays in its word's piece.
    assert qwen.decode(qwen.encode("x\u0301y")) == "x\u0301y"


def test_qwen_round_trip_on_corpora(shared_data, qwen):
    for line in _corpus_lines(shared_data):
        ids = qwen.encode(line)
        assert qwen.decode(ids) == unicodedata.normalize("NFC", line)


def test_hf_round_trip_and_specials(shared_data, hf_qwen3):
    assert hf_qwen3.encode("<|im_start|>hello<|im_end|>") == [151644, 14990, 151645]
    assert hf_qwen3.vocab_size == 151_669
    assert hf_qwen3.think_ids == (151_667, 151_668)
    for line in _corpus_lines(shared_data):
        ids = hf_qwen3.encode(line)
        assert hf_qwen3.decode(ids) == unicodedata.normalize("NFC", line)
        assert hf_qwen3.decode(ids) == hf_qwen3._tok.decode(ids, skip_special_tokens=False)
        _assert_bytes_consistent(hf_qwen3, ids)


def test_hf_splits_multibyte_characters_into_byte_tokens(hf_qwen3):
    ids = hf_qwen3.encode(" 🎉")
    assert len(ids) == 3
    assert b"".join(hf_qwen3.token_bytes(i) for i in ids) == " 🎉".encode()
    assert all(len(hf_qwen3.token_bytes(i)) < 4 for i in ids)


def test_sentencepiece_trains_fast_and_maps_pieces(sp_models, sp):
    assert sp_models["train_seconds"] < 5.0
    assert sp.vocab_size == 600
    for text in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]:
        assert sp.encode(f"a{text}b")[1] == sp.special_id(text)
    assert sp.think_ids == (sp.special_id("<think>"), sp.special_id("</think>"))
    assert sp.eos_ids == frozenset(
        {sp.special_id("<|im_end|>"), sp.special_id("<|endoftext|>"), sp.special_id("</s>")}
    )
    assert sp.token_bytes(sp.special_id("</s>")) == b""
    ids = sp.encode("你好")  # unseen characters fall back to bytes
    assert len(ids) == 6 and b"".join(sp.token_bytes(i) for i in ids) == "你好".encode()


@pytest.mark.parametrize("which", ["plain", "prefixed"])
def test_sentencepiece_round_trip_matches_sentencepiece(shared_data, sp_models, which):
    tok = sp_models[which]
    reference = sentencepiece.SentencePieceProcessor(model_file=str(sp_models[f"{which}_path"]))
    for line in _corpus_lines(shared_data) + ["Hi <think>ok</think> 你好 🎉\n<|im_end|>"]:
        ids = tok.encode(line)
        assert ids == reference.encode(line)
        assert tok.decode(ids) == reference.decode(ids)
        if not line.startswith(" "):
            assert tok.decode(ids) == line


def test_load_tokenizer_picks_the_backend(shared_data, qwen_dir, sp_models, tmp_path):
    assert isinstance(load_tokenizer(qwen_dir), QwenBpeTokenizer)
    hf = load_tokenizer(shared_data / "qwen-tokenizer")
    assert isinstance(hf, HfTokenizer)
    assert hf.eos_ids == frozenset({151_643, 151_645})
    assert isinstance(load_tokenizer(sp_models["plain_path"].parent), SentencePieceTokenizer)
    with pytest.raises(FileNotFoundError, match="no tokenizer found"):
        load_tokenizer(tmp_path)
