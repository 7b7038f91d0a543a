"""The allowed-token mask inside the sampling step (`sampling.apply_penalties`).

Against a numpy reference: a constrained row's disallowed tokens become -inf and its allowed
ones keep their penalised value; unconstrained rows in the same batch come back bit-identical to
a batch with no mask at all; greedy and sampled rows only ever draw allowed tokens (random masks,
including a single allowed token and one past the last full word); masks as the grammar matcher
builds them (the demo tokenizer's JSON masks, padded to a larger model vocabulary) select
exactly the matcher's tokens; and one jitted executable serves batches with and without masks.
"""

from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import ninfer_jax
from ninfer_jax.frontend import Frontend
from ninfer_jax.frontend.grammar import GrammarCompiler, allowed_ids
from ninfer_jax.program.sampling import apply_penalties, sample, sampling_arrays
from ninfer_jax.sampling_params import StructuredOutput
from tests.program.test_sampling import traced

V = 100  # not a multiple of 32: the last word is partial
W = -(-V // 32)


def _pack(allowed: np.ndarray) -> np.ndarray:
    """bool [V] -> [W] uint32 bitmask (bit i of word j: token 32 j + i)."""
    bits = np.zeros(W * 32, np.uint8)
    bits[: len(allowed)] = allowed
    return np.packbits(bits, bitorder="little").view(np.uint32)


@jax.jit
def _penalised(logits, arrays, counts, prompt_mask):
    return apply_penalties(logits, arrays, counts, prompt_mask)


@jax.jit
def _step(logits, arrays, counts, prompt_mask, step_index):
    return sample(apply_penalties(logits, arrays, counts, prompt_mask), arrays, step_index)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_mask_matches_reference(data):
    b = data.draw(st.integers(1, 4))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    logits = rng.normal(size=(b, V)).astype(np.float32) * 3
    counts = rng.integers(0, 3, size=(b, V)).astype(np.int32)
    prompt_mask = rng.random((b, V)) < 0.2
    rows, masks, allowed = [], [], []
    for _ in range(b):
        kind = data.draw(st.sampled_from(["none", "random", "one", "last"]))
        keep = np.zeros(V, bool)
        if kind == "random":
            keep = rng.random(V) < 0.3
            keep[rng.integers(V)] = True
        elif kind in ("one", "last"):
            keep[V - 1 if kind == "last" else rng.integers(V)] = True
        rows.append({"temperature": float(data.draw(st.sampled_from([0.0, 0.7, 1.3]))),
                     "seed": 7, "repetition_penalty": 1.2, "presence_penalty": 0.3})
        masks.append(None if kind == "none" else _pack(keep))
        allowed.append(keep if kind != "none" else np.ones(V, bool))
    arrays = sampling_arrays(rows, masks=masks, mask_words=W)
    plain = sampling_arrays(rows, mask_words=W)
    got = np.asarray(_penalised(logits, arrays, counts, prompt_mask))
    base = np.asarray(_penalised(logits, plain, counts, prompt_mask))
    want = np.where(np.stack(allowed), base, -np.inf)
    np.testing.assert_array_equal(got, want)
    for i, m in enumerate(masks):
        if m is None:  # unconstrained rows: bit-identical to a batch without masks
            assert got[i].tobytes() == base[i].tobytes()
    steps = np.arange(b, dtype=np.int32) + data.draw(st.integers(0, 1000))
    tokens = np.asarray(_step(logits, arrays, counts, prompt_mask, steps).tokens)
    for i, t in enumerate(tokens):
        assert allowed[i][t], (i, t)


def test_grammar_masks_select_the_matchers_tokens():
    frontend = Frontend.load(pathlib.Path(ninfer_jax.__file__).parent / "assets" / "demo")
    vocab = frontend.tokenizer.vocab_size + 40  # the model's vocabulary is larger
    compiler = GrammarCompiler(frontend.tokenizer, vocab)
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    matcher = compiler.matcher(StructuredOutput("json_schema", json.dumps(schema)))
    rng = np.random.default_rng(0)
    jitted = jax.jit(lambda lg, ar: apply_penalties(lg, ar, np.zeros((1, vocab), np.int32),
                                                    np.zeros((1, vocab), bool)))
    for _ in range(12):
        mask = matcher.mask()
        logits = rng.normal(size=(1, vocab)).astype(np.float32)
        arrays = sampling_arrays([{"temperature": 0.0}], masks=[mask],
                                 mask_words=compiler.mask_words)
        out = np.asarray(jitted(logits, arrays))[0]
        assert np.array_equal(np.flatnonzero(np.isfinite(out)), allowed_ids(mask))
        token = int(np.argmax(out))
        if token in frontend.tokenizer.eos_ids:
            break
        assert matcher.advance([token])
    assert matcher.is_accepting


def test_one_executable_with_and_without_masks():
    logits = np.zeros((2, V), np.float32)
    counts, prompt_mask = np.zeros((2, V), np.int32), np.zeros((2, V), bool)
    rows = [{"temperature": 0.0}, {"temperature": 0.0}]
    _step(logits, sampling_arrays(rows, mask_words=W), counts, prompt_mask, np.zeros(2, np.int32))
    with traced() as traces:
        keep = np.zeros(V, bool)
        keep[37] = True
        out = _step(logits, sampling_arrays(rows, masks=[None, _pack(keep)], mask_words=W),
                    counts, prompt_mask, np.zeros(2, np.int32))
    assert traces == []
    assert np.asarray(out.tokens).tolist() == [0, 37]
