"""Frontend fixtures: the Qwen tokenizers from ../shared/data and tiny sentencepiece models."""

from __future__ import annotations

import pathlib
import time

import pytest
import sentencepiece

from ninfer_jax.frontend import HfTokenizer, QwenBpeTokenizer, SentencePieceTokenizer

SP_CONTROL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>"]


@pytest.fixture(scope="session")
def qwen_dir(shared_data: pathlib.Path) -> pathlib.Path:
    return shared_data / "qwen-tokenizer" / "qwen3.5"


@pytest.fixture(scope="session")
def qwen(qwen_dir: pathlib.Path) -> QwenBpeTokenizer:
    return QwenBpeTokenizer(qwen_dir)


@pytest.fixture(scope="session")
def hf_qwen3(shared_data: pathlib.Path) -> HfTokenizer:
    return HfTokenizer(shared_data / "qwen-tokenizer" / "tokenizer.json")


def _train_sentencepiece(lines: list[str], path: pathlib.Path, dummy_prefix: bool) -> float:
    """Trains a 600-piece byte-fallback BPE model at `path`; returns the seconds it took."""
    start = time.perf_counter()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(path.with_suffix("")),
        vocab_size=600,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        user_defined_symbols=SP_CONTROL_TOKENS,
        add_dummy_prefix=dummy_prefix,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        minloglevel=2,
    )
    return time.perf_counter() - start


@pytest.fixture(scope="session")
def sp_models(shared_data: pathlib.Path, tmp_path_factory) -> dict[str, object]:
    """Two tiny models trained on ~30 KB of TinyStories: without and with a dummy prefix."""
    text = (shared_data / "tinystories" / "train_head_cased.txt").read_text()[:30_000]
    lines = [line for line in text.split("\n") if line.strip()]
    root = tmp_path_factory.mktemp("sp")
    plain, prefixed = root / "plain" / "tokenizer.model", root / "prefixed.model"
    plain.parent.mkdir()
    seconds = _train_sentencepiece(lines, plain, dummy_prefix=False)
    seconds += _train_sentencepiece(lines, prefixed, dummy_prefix=True)
    return {
        "plain": SentencePieceTokenizer(plain),
        "prefixed": SentencePieceTokenizer(prefixed),
        "plain_path": plain,
        "prefixed_path": prefixed,
        "train_seconds": seconds,
    }


@pytest.fixture(scope="session")
def sp(sp_models) -> SentencePieceTokenizer:
    return sp_models["plain"]
