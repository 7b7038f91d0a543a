"""Per-token log-probs and greedy flags against transformers (committed fixture logits) and our
full-forward oracle, for single windows, contexts and rolling windows over a long text."""

from __future__ import annotations

import numpy as np
import pytest

from ninfer_jax.scoring import ScoreInputError, ScoreRequest, WindowKey
from ninfer_jax.scoring.core import SharedKey
from tests.models.conftest import reference, rel_err
from tests.scoring.conftest import (
    WIDTH,
    core,
    log_softmax,
    oracle_window,
    scorer,
    transformers_logprobs,
)

TOL = 1e-5  # fp32, max error relative to the largest |log-prob| (as tests/models' rel_err)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_single_windows_match_transformers(name):
    ids = reference(name)["token_ids"]
    want, want_greedy = transformers_logprobs(name)
    results = scorer(name).score(token_ids=ids.tolist())
    got = np.stack([r.token_logprobs for r in results])
    assert got.dtype == np.float32 and got.shape == want.shape
    assert rel_err(got, want) <= TOL
    np.testing.assert_array_equal(np.stack([r.greedy_flags for r in results]), want_greedy)
    for r, w, g in zip(results, want, want_greedy):
        assert r.num_tokens == WIDTH - 1
        np.testing.assert_allclose(r.sum_logprob, w.sum(), rtol=TOL)
        assert r.is_greedy == g.all()
        np.testing.assert_allclose(r.perplexity, np.exp(-w.mean()), rtol=TOL)


def test_is_greedy_is_true_for_a_greedy_continuation():
    """The fixture's transformers greedy tokens, scored after their prompt, are all argmaxes."""
    ref = reference("dense")
    n = int(ref["greedy_prompt_len"])
    prompts, greedy = ref["token_ids"][:, :n], ref["greedy_tokens"]
    results = scorer("dense").score(token_ids=greedy.tolist(), contexts=prompts.tolist())
    assert all(r.is_greedy and r.num_tokens == greedy.shape[1] for r in results)
    flipped = greedy.copy()
    flipped[:, -1] = (flipped[:, -1] + 1) % 384
    results = scorer("dense").score(token_ids=flipped.tolist(), contexts=prompts.tolist())
    assert not any(r.is_greedy for r in results)
    assert all(r.greedy_flags[:-1].all() for r in results)


def test_greedy_flags_follow_argmax_on_ties():
    """Logits that tie exactly (two equal head rows): the flag is set for the first index of
    the maximum only, as argmax (and lm-evaluation-harness) has it, in whichever lm-head chunk
    the tie falls; rows without ties take the log-softmax's passes alone."""
    import jax
    import jax.numpy as jnp

    from ninfer_jax.program.scoring_steps import logits_chunk, target_scores
    from ninfer_jax.testing import tiny_dense

    cfg = tiny_dense()
    rng = np.random.default_rng(0)
    head = rng.normal(size=(cfg.vocab_size, cfg.hidden_size)).astype(np.float32)
    head[200] = head[5]  # logits 5 and 200 are equal for every hidden state
    n = 3 * logits_chunk(cfg, 10**6) + 7
    hidden = rng.normal(size=(n, cfg.hidden_size)).astype(np.float32)
    tied = [1, n - 2]  # one row in the first chunk, one in the last
    hidden[tied] = 4.0 * head[5]  # logit 5 (and 200) is the maximum there
    normed = hidden / np.sqrt((hidden * hidden).mean(-1, keepdims=True) + cfg.rms_norm_eps)
    logits = normed @ head.T  # the final norm runs inside the chunks (its weight 0: a factor 1)
    # equal rows of the head give equal logits, which a BLAS need not round alike (rows where
    # 5 and 200 are the maximum by chance came out 2e-6 apart on one machine's numpy)
    logits[:, 200] = logits[:, 5]
    targets = logits.argmax(-1)
    targets[tied[0]] = 5  # the first index of the maximum: greedy
    targets[tied[1]] = 200  # the later one: not greedy
    targets[3] = (targets[3] + 1) % cfg.vocab_size
    logprobs, greedy, _, _ = jax.jit(lambda h, t: target_scores(
        {"embed": jnp.asarray(head), "final_norm": jnp.zeros(cfg.hidden_size)}, cfg, h, t))(
        hidden, targets)
    want = logits.argmax(-1) == targets
    assert want[tied[0]] and not want[tied[1]] and not want[3] and want.sum() == n - 2
    np.testing.assert_array_equal(np.asarray(greedy), want)
    lsm = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)
                          ) - logits.max(-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(logprobs), lsm[np.arange(n), targets], atol=1e-4)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_contexts_score_only_the_continuation(name):
    ids = reference(name)["token_ids"]
    want, want_greedy = transformers_logprobs(name)
    cut = [1, 17, 38]
    results = scorer(name).score(token_ids=[r[c:].tolist() for r, c in zip(ids, cut)],
                                 contexts=[r[:c].tolist() for r, c in zip(ids, cut)])
    for r, c, w, g in zip(results, cut, want, want_greedy):
        assert r.num_tokens == WIDTH - c
        assert rel_err(r.token_logprobs, w[c - 1:]) <= TOL
        np.testing.assert_array_equal(r.greedy_flags, g[c - 1:])


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_rolling_windows_over_a_long_text_match_transformers(name):
    """window = stride = 40 over the three fixture rows joined (plus one token): every window
    reads exactly one fixture row, so transformers' logits of that row are the reference."""
    ref = reference(name)
    ids, logits = ref["token_ids"], ref["logits"]
    text = np.concatenate([ids.reshape(-1), [7]])
    targets = text[1:].reshape(3, WIDTH)
    lsm = log_softmax(logits)
    want = np.take_along_axis(lsm, targets[..., None], -1)[..., 0].reshape(-1)
    want_greedy = (logits.argmax(-1) == targets).reshape(-1)
    [r] = scorer(name, window=WIDTH, stride=WIDTH).score(token_ids=[text.tolist()])
    assert r.num_tokens == len(text) - 1
    assert rel_err(r.token_logprobs, want) <= TOL
    np.testing.assert_array_equal(r.greedy_flags, want_greedy)


@pytest.mark.parametrize("name,stride", [("dense", 13), ("moe", 40), ("dense", 1)])
def test_rolling_windows_with_a_stride_match_the_full_forward_oracle(name, stride):
    """Random-length texts in windows of 40 with carried context, window by window against our
    full forward (proven equal to transformers in tests/models) over the same tokens."""
    rng = np.random.default_rng(stride)
    sc = scorer(name, window=WIDTH, stride=stride)
    lengths = [2, 41, 42, 97] if stride > 1 else [45]
    texts = [rng.integers(0, 320, n) for n in lengths]
    results = sc.score(token_ids=[t.tolist() for t in texts])
    for text, r in zip(texts, results):
        want, want_greedy = [], []
        for w in sc.core.plan(ScoreRequest(text, 1)):
            lp, g = oracle_window(name, text[w.start : w.end + 1], w.num_targets)
            want.append(lp)
            want_greedy.append(g)
        assert r.num_tokens == len(text) - 1
        assert rel_err(r.token_logprobs, np.concatenate(want)) <= TOL
        np.testing.assert_array_equal(r.greedy_flags, np.concatenate(want_greedy))


def test_scores_do_not_depend_on_batch_company():
    """A text scored alone (in a call of filler rows) equals the same text in a full batch."""
    ids = reference("dense")["token_ids"]
    sc = scorer("dense")
    together = sc.score(token_ids=ids.tolist())
    alone = [sc.score(token_ids=[row.tolist()])[0] for row in ids]
    for a, b in zip(together, alone):
        np.testing.assert_array_equal(a.token_logprobs, b.token_logprobs)


def test_texts_and_contexts_are_split_as_lm_eval_does():
    sc = scorer("dense")
    [whole] = sc.score(texts=["The cat sat."])
    [pair] = sc.score(texts=[" sat."], contexts=["The cat"])
    [spaced] = sc.score(texts=["sat."], contexts=["The cat "])  # the space moves to the text
    assert whole.num_tokens == len("The cat sat.") - 1
    assert pair.num_tokens == spaced.num_tokens == len(" sat.")
    np.testing.assert_array_equal(pair.token_logprobs, whole.token_logprobs[-5:])
    np.testing.assert_array_equal(spaced.token_logprobs, pair.token_logprobs)
    assert sc.perplexity("The cat sat.") == pytest.approx(whole.perplexity, rel=1e-6)


@pytest.mark.parametrize("kwargs,match", [
    (dict(texts=[""]), "nothing to score"),
    (dict(texts=["x"]), "nothing to score"),
    (dict(token_ids=[[1, 2, 999]]), r"must be in \[0, 384\)"),
    (dict(token_ids=[list(range(WIDTH + 2))]), "too long"),
    (dict(token_ids=[[1, 2]], contexts=[list(range(100))]), None),
])
def test_bad_items_are_refused_with_a_reason(kwargs, match):
    sc = scorer("dense")
    if match is None:  # a long context is cut from the left, as lm-eval does
        [r] = sc.score(**kwargs)
        assert r.num_tokens == 2
        return
    with pytest.raises(ScoreInputError, match=match):
        sc.score(**kwargs)


def test_the_core_keeps_only_its_window_executables():
    c = core("dense", window=WIDTH, stride=13)
    assert c.keys() == [WindowKey(3, WIDTH), SharedKey(1, WIDTH, 4, WIDTH // 2)]
    assert core("dense").keys() == c.keys()
    assert core("dense", plain=True).keys() == [WindowKey(3, WIDTH)]
