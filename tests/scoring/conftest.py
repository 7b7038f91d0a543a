"""Scoring cores shared by the scoring tests, and the transformers reference log-probs.

Every core here compiles the same window shape (3 rows of 40 tokens, the fixtures' row length)
and, unless plain, the same shared-context shape (one context of 40, four continuation rows of
20), so one executable of each per fixture model serves all of them.
"""

from __future__ import annotations

import functools
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.models.qwen3_6 import forward
from ninfer_jax.scoring import CausalScoreCore, Scorer, ScoringConfig
from ninfer_jax.testing import ByteTokenizer
from tests.conftest import FIXTURES
from tests.models.conftest import loaded, reference

WIDTH = 40  # the fixtures' row length: every window in these tests fits one 40-token row
ROWS = 3


@functools.lru_cache(maxsize=None)
def core(name: str = "dense", window: int | None = None, stride: int | None = None,
         plain: bool = False) -> CausalScoreCore:
    """plain: no packing and no shared contexts (every window alone in its row)."""
    m = loaded(name)
    scfg = ScoringConfig(window=window, stride=stride, max_len=None if window else WIDTH,
                         max_batch_tokens=ROWS * WIDTH, pack=not plain,
                         share_contexts=not plain)
    return CausalScoreCore(m.config, m.params, scfg)


def scorer(name: str = "dense", window: int | None = None, stride: int | None = None) -> Scorer:
    return Scorer(core(name, window, stride), ByteTokenizer(loaded(name).config.vocab_size))


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def transformers_logprobs(name: str) -> tuple[np.ndarray, np.ndarray]:
    """(log p of token t+1 at position t [3, 39], argmax == token t+1 [3, 39]) from the committed
    transformers logits of the fixture rows."""
    ref = reference(name)
    ids, logits = ref["token_ids"], ref["logits"][:, :-1]
    lp = np.take_along_axis(log_softmax(logits), ids[:, 1:, None], -1)[..., 0]
    return lp, logits.argmax(-1) == ids[:, 1:]


@functools.lru_cache(maxsize=None)
def _padded_forward(name: str):
    m = loaded(name)
    return jax.jit(lambda ids: forward(m.params, m.config, ids))


def oracle_window(name: str, ids: np.ndarray, num_targets: int) -> tuple[np.ndarray, np.ndarray]:
    """Our full forward over one window `ids` (<= 40 tokens, right-padded: causal attention keeps
    the padding invisible), scoring its last num_targets next tokens from ids[-num_targets:] on;
    the last target is `ids`' successor, so pass the window plus that one token."""
    n = len(ids) - 1
    row = np.zeros((1, WIDTH), np.int32)
    row[0, :n] = ids[:-1]
    logits = np.asarray(_padded_forward(name)(jnp.asarray(row)))[0, :n]
    lp = np.take_along_axis(log_softmax(logits), ids[1:, None], -1)[:, 0]
    greedy = logits.argmax(-1) == ids[1:]
    return lp[n - num_targets:], greedy[n - num_targets:]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> pathlib.Path:
    """The dense fixture plus a byte-level `tokenizer.json` whose ids are the byte values; ids
    256.. (up to the model's 384) are special tokens, `<|endoftext|>` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from ninfer_jax.frontend.hf_backend import _byte_level_alphabet

    path = tmp_path_factory.mktemp("byte_model")
    for name in ("config.json", "model.safetensors"):
        (path / name).symlink_to(FIXTURES / "dense" / name)
    tok = Tokenizer(models.BPE(vocab=_byte_level_alphabet(), merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    vocab_size = loaded("dense").config.vocab_size
    tok.add_special_tokens(["<|endoftext|>"] + [f"<|x{i}|>" for i in range(257, vocab_size)])
    tok.save(str(path / "tokenizer.json"))
    return path
