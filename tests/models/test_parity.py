"""Logits parity with transformers on the committed fixtures (DESIGN §13), fp32 and bf16."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from tests.models.conftest import NAMES, loaded, reference, rel_err


@pytest.mark.parametrize("name", NAMES)
def test_fp32_logits_match_transformers(name):
    ref = reference(name)
    assert ref["token_ids"].shape[0] >= 3 and ref["token_ids"].shape[1] >= 32
    logits = loaded(name).logits(ref["token_ids"])
    assert logits.dtype == np.float32 and logits.shape == ref["logits"].shape
    assert rel_err(logits, ref["logits"]) <= 1e-4


@pytest.mark.parametrize("name", NAMES)
def test_teacher_forced_argmax_reproduces_transformers_greedy(name):
    ref = reference(name)
    n = int(ref["greedy_prompt_len"])
    greedy = ref["greedy_tokens"]
    seq = np.concatenate([ref["token_ids"][:, :n], greedy], axis=1)
    logits = loaded(name).logits(seq)
    predicted = logits[:, n - 1 : n - 1 + greedy.shape[1]].argmax(-1)
    np.testing.assert_array_equal(predicted, greedy)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_bf16_runs_and_top1_agrees_with_fp32_where_decided(name):
    """bf16 weights + activations against fp32.

    The fixtures are random models whose top-1/top-2 logit margins are often tiny: merely
    rounding the weights to bf16 (fp32 maths) flips 1.7% (dense) and 3.3% (MoE) of their
    argmaxes, so no bf16 implementation reaches 99% on all positions. The check is therefore
    made where fp32's top-1 margin is at least 0.1 nats (about two thirds of the positions,
    still dominated by near-ties), plus a bound on the logit error everywhere.
    """
    ref = reference(name)
    fp32 = loaded(name).logits(ref["token_ids"])
    model = loaded(name, "bfloat16")
    assert all(leaf.dtype == np.dtype("bfloat16") for leaf in jax.tree.leaves(model.params))
    bf16 = model.logits(ref["token_ids"])
    assert np.isfinite(bf16).all()
    top2 = np.sort(fp32, axis=-1)[..., -2:]
    decided = (top2[..., 1] - top2[..., 0]) >= 0.1
    assert decided.mean() >= 0.5
    agree = (bf16.argmax(-1) == fp32.argmax(-1))[decided].mean()
    assert agree >= 0.99, f"bf16 top-1 agrees on {agree:.4f} of decided positions"
    assert rel_err(bf16, fp32) <= 0.4
