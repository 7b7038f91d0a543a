"""Speculative acceptance: greedy prefixes with exact penalties and limits, equivalence with
`sample()` when every draft is right, the residual fallback, bad drafts and shapes, one
compilation for mixed rows, and the output distribution of two committed tokens against a numpy
oracle of non-speculative sampling (chi-square at fixed seeds), with a check that the test
rejects a wrong rule."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.program.sampling import apply_penalties, count_tokens, sample, sampling_arrays
from ninfer_jax.program.speculative import accept, draft_token
from tests.program.test_sampling import _reference_mask, _reference_penalties, traced

V = 8  # one vocab everywhere, so each jitted function compiles once per batch shape
K = 3  # drafts in the small tests (T = 4)
jit_accept = jax.jit(accept)
jit_step = jax.jit(lambda logits, arrays, counts, mask, step: sample(
    apply_penalties(logits, arrays, counts, mask), arrays, step))


def _reference_logprobs(logits, drafts, rows, counts=None, mask=None) -> np.ndarray:
    """[B, T, V] float64 log-softmax of each position's penalised logits, position i counting
    drafts[:, :i] as generated (numpy oracle)."""
    b, t, _ = logits.shape
    counts = np.zeros((b, V), np.int32) if counts is None else counts.copy()
    mask = np.zeros((b, V), bool) if mask is None else mask
    penalty = {f: np.array([r.get(f, d) for r in rows]) for f, d in [
        ("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)]}
    out = np.zeros((b, t, V))
    for i in range(t):
        pen = _reference_penalties(logits[:, i], counts, mask, penalty["presence_penalty"],
                                   penalty["frequency_penalty"], penalty["repetition_penalty"])
        pen -= pen.max(-1, keepdims=True)
        out[:, i] = pen - np.log(np.exp(pen).sum(-1, keepdims=True))
        if i < t - 1:
            counts[np.arange(b), np.asarray(drafts)[:, i]] += 1
    return out


def _call(logits, drafts, rows, counts=None, mask=None, steps=None, limit=None, q=None):
    b = logits.shape[0]
    return jit_accept(
        np.asarray(logits, np.float32),
        np.asarray(drafts, np.int32),
        np.zeros((b, K, V), np.float32) if q is None else np.asarray(q, np.float32),
        sampling_arrays(rows),
        np.zeros((b, V), np.int32) if counts is None else counts,
        np.zeros((b, V), bool) if mask is None else mask,
        np.zeros(b, np.int32) if steps is None else np.asarray(steps, np.int32),
        np.full(b, K + 1, np.int32) if limit is None else np.asarray(limit, np.int32),
    )


def _peaked(*argmaxes: int, runner_up: dict | None = None) -> np.ndarray:
    """[T, V] logits with the given argmax per position (value 2.0, others 0.0); runner_up
    {position: (token, value)} adds a second-best token."""
    logits = np.zeros((len(argmaxes), V), np.float32)
    for i, t in enumerate(argmaxes):
        logits[i, t] = 2.0
    for i, (t, value) in (runner_up or {}).items():
        logits[i, t] = value
    return logits


# ---------------------------------------------------------------- greedy


def test_greedy_accepts_the_matching_prefix_with_exact_penalties_and_limits():
    greedy = {"temperature": 0.0}
    logits = np.stack([
        _peaked(1, 2, 3, 4),
        _peaked(1, 2, 3, 4),
        # Position 2 prefers 3 (2.0) over 6 (1.8), unless draft 0 (= 3) was counted first.
        _peaked(3, 0, 3, 5, runner_up={2: (6, 1.8)}),
        _peaked(1, 2, 3, 4),
    ])
    drafts = [[1, 2, 3], [1, 5, 3], [3, 0, 3], [1, 2, 3]]
    rows = [greedy, greedy, dict(greedy, frequency_penalty=0.5), greedy]
    out = _call(logits, drafts, rows, limit=[4, 4, 4, 2])
    assert out.num.tolist() == [4, 2, 3, 2]
    assert out.tokens.tolist() == [
        [1, 2, 3, 4],  # every draft right: the target's token after them is the bonus
        [1, 2, 2, 2],  # draft 1 wrong: the target's token replaces it; later slots repeat it
        [3, 0, 6, 6],  # 3 - 0.5 < 1.8 at position 2: the penalty saw draft 0
        [1, 2, 2, 2],  # all right, but the row may commit only 2
    ]
    want = _reference_logprobs(logits, drafts, rows)
    got = np.asarray(out.logprobs)
    for r, n in enumerate(out.num.tolist()):
        np.testing.assert_allclose(got[r, :n], want[r, np.arange(n), out.tokens[r, :n]],
                                   rtol=1e-6)


def test_greedy_repetition_penalty_and_committed_counts():
    greedy = {"temperature": 0.0}
    counts = np.zeros((4, V), np.int32)
    counts[1, 2] = 3  # row 1 has already generated token 2 three times
    mask = np.zeros((4, V), bool)
    mask[3, 4] = True  # row 3's prompt holds token 4
    logits = np.stack([
        # Position 1 prefers 2 (2.0) over 7 (1.5), unless draft 0 (= 2) is penalised: 2 / 1.5.
        _peaked(2, 2, 5, 5, runner_up={1: (7, 1.5)}),
        _peaked(2, 1, 1, 1, runner_up={0: (6, 1.0)}),  # committed counts: 2 - 3 * 0.5 < 1
        _peaked(1, 2, 3, 4),
        # Prompt token 4: 2 / 2 < 1.5 at position 0, so 0 is drafted; at position 1 the draft
        # counts as generated: 2 / 2 < 1.5 again, so 5 replaces the draft 0.
        _peaked(4, 0, 0, 0, runner_up={0: (0, 1.5), 1: (5, 1.5)}),
    ])
    rows = [dict(greedy, repetition_penalty=1.5), dict(greedy, frequency_penalty=0.5), greedy,
            dict(greedy, repetition_penalty=2.0)]
    drafts = [[2, 2, 5], [6, 1, 1], [1, 2, 3], [0, 0, 0]]
    out = _call(logits, drafts, rows, counts=counts, mask=mask, limit=[4, 4, 1, 4])
    assert out.num.tolist() == [2, 4, 1, 2]
    assert out.tokens.tolist() == [[2, 7, 7, 7], [6, 1, 1, 1], [1, 1, 1, 1], [0, 5, 5, 5]]
    want = _reference_logprobs(logits, drafts, rows, counts, mask)
    for r, n in enumerate(out.num.tolist()):
        np.testing.assert_allclose(out.logprobs[r, :n],
                                   want[r, np.arange(n), out.tokens[r, :n]], rtol=1e-6)


def test_all_right_drafts_reproduce_sample_at_every_position():
    """Drafts equal to sample()'s tokens (the argmax for greedy rows) are all accepted and each
    output equals sample() at its position. A sampled row with q = 0 accepts any draft the
    target allows, so its bonus token must be sample()'s own draw at step_index + K."""
    rng = np.random.default_rng(0)
    rows = [
        {"temperature": 0.0},
        {"temperature": 0.0, "presence_penalty": 1.5, "frequency_penalty": 0.7,
         "repetition_penalty": 1.3},
        {"temperature": 0.9, "top_k": 4, "top_p": 0.9, "seed": 17},
        {"temperature": 1.2, "min_p": 0.1, "repetition_penalty": 1.4, "frequency_penalty": 0.4,
         "seed": 2**32 - 1},
    ]
    arrays = sampling_arrays(rows)
    for trial in range(4):
        logits = (rng.standard_normal((4, K + 1, V)) * 2).astype(np.float32)
        counts = np.where(rng.random((4, V)) < 0.3, rng.integers(1, 3, (4, V)), 0).astype(np.int32)
        mask = rng.random((4, V)) < 0.3
        steps = rng.integers(0, 1000, 4).astype(np.int32)
        seen, expected, logprobs = counts.copy(), [], []
        for i in range(K + 1):
            out = jit_step(logits[:, i], arrays, seen, mask, steps + i)
            token = np.asarray(out.tokens)
            expected.append(token)
            logprobs.append(np.asarray(out.logprobs))
            seen = seen.copy()
            seen[np.arange(4), token] += 1
        expected = np.stack(expected, 1)
        got = _call(logits, expected[:, :K], rows, counts=counts, mask=mask, steps=steps)
        assert got.num.tolist() == [K + 1] * 4, trial
        np.testing.assert_array_equal(got.tokens, expected)
        np.testing.assert_allclose(got.logprobs, np.stack(logprobs, 1), rtol=1e-6)


# ---------------------------------------------------------------- rejections, bad input


def test_an_all_zero_residual_falls_back_to_the_target():
    """q = 2p accepts half the drafts and leaves max(0, p - q) = 0; the token at the rejection
    must still come from p (tokens 3 and 5), not from an all -inf draw."""
    logits = np.full((4, K + 1, V), -1e4, np.float32)
    logits[:, :, [3, 5]] = 0.0  # p = 1/2, 1/2 exactly
    q = np.zeros((4, K, V), np.float32)
    q[:, :, [3, 5]] = 1.0
    rows = [{"temperature": 1.0, "seed": s} for s in range(4)]
    drafts = np.full((4, K), 3)
    rejected = 0
    for step in range(0, 80, 10):
        out = _call(logits, drafts, rows, steps=[step] * 4, q=q)
        for r, n in enumerate(out.num.tolist()):
            assert set(out.tokens[r, :n].tolist()) <= {3, 5}
            rejected += n <= K
    assert rejected >= 8  # about half of the 32 rows stop early


def test_out_of_vocab_drafts_are_rejected_and_rows_do_not_see_their_neighbours():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((4, K + 1, V))).astype(np.float32)
    rows = [
        {"temperature": 1.0, "seed": 5},
        {"temperature": 0.0, "frequency_penalty": 1.0},
        {"temperature": 0.7, "top_k": 3, "seed": 9},
        {"temperature": 1.0, "seed": 6},
    ]
    drafts = np.array([[-1, 0, 0], [V, 0, 0], [V + 5, 1, 1], [2, 3, 4]])
    q = np.full((4, K, V), 1 / V, np.float32)
    steps = np.array([3, 4, 5, 6])
    out = _call(logits, drafts, rows, steps=steps, q=q)
    assert out.num.tolist()[:3] == [1, 1, 1]
    assert ((out.tokens[:3] >= 0) & (out.tokens[:3] < V)).all()

    def same_row(again, j: int, i: int) -> None:  # again's row j is out's row i
        n = int(out.num[i])
        assert int(again.num[j]) == n
        assert again.tokens[j, :n].tolist() == out.tokens[i, :n].tolist()
        assert again.logprobs[j, :n].tolist() == out.logprobs[i, :n].tolist()

    rev = [3, 2, 1, 0]
    again = _call(logits[rev], drafts[rev], [rows[i] for i in rev], steps=steps[rev], q=q[rev])
    for j, i in enumerate(rev):
        same_row(again, j, i)
    greedy_neighbours = [rows[0]] + [{"temperature": 0.0}] * 3
    same_row(_call(logits, drafts, greedy_neighbours, steps=steps, q=q), 0, 0)


def test_bad_shapes_name_the_argument():
    b = 2
    good = {
        "target_logits": np.zeros((b, K + 1, V), np.float32),
        "drafts": np.zeros((b, K), np.int32),
        "draft_probs": np.zeros((b, K, V), np.float32),
        "arrays": sampling_arrays([{"temperature": 0.0}] * b),
        "counts": np.zeros((b, V), np.int32),
        "prompt_mask": np.zeros((b, V), bool),
        "step_index": np.zeros(b, np.int32),
        "limit": np.ones(b, np.int32),
    }
    cases = {
        "target_logits": np.zeros((b, 1, V), np.float32),
        "drafts": np.zeros((b, K + 1), np.int32),
        "draft_probs": np.zeros((b, K, V + 1), np.float32),
        "counts": np.zeros((b + 1, V), np.int32),
        "prompt_mask": np.zeros((b, V - 1), bool),
        "step_index": np.zeros((b, 1), np.int32),
        "limit": np.zeros(b + 1, np.int32),
    }
    for name, bad in cases.items():
        with pytest.raises(ValueError, match=name):
            accept(**dict(good, **{name: bad}))
    with pytest.raises(ValueError, match="drafts must be an integer"):
        accept(**dict(good, drafts=np.zeros((b, K), np.float32)))


def test_mixed_rows_share_one_compilation():
    rows = [
        {"temperature": 0.0},
        {"temperature": 0.0, "presence_penalty": 2.0, "repetition_penalty": 1.2},
        {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 3},
        {"temperature": 1.2, "min_p": 0.1, "frequency_penalty": 0.5, "seed": 4},
    ]
    swapped = [{"temperature": 0.5, "top_k": 1, "seed": 9}, rows[3], rows[0], rows[1]]
    logits = np.random.default_rng(2).standard_normal((4, K + 1, V)).astype(np.float32)
    drafts = np.tile(np.arange(K), (4, 1))
    with traced() as traces:
        _call(logits, drafts, rows)
        _call(logits * 2, drafts + 1, swapped, limit=[1, 2, 3, 4], steps=[5, 6, 7, 8])
        _call(logits, drafts, [{"temperature": 0.0}] * 4)  # all greedy: the same executable
    # `jit_accept` is shared with the other tests: at most the first call of this shape traces.
    assert len(traces) <= 1


# ---------------------------------------------------------------- the output distribution

N = 12_000  # draws per setting
DIST_K = 2  # two drafts: T = 3
GROUPS = {
    "plain": {"temperature": 1.0},
    "top_k": {"temperature": 1.0, "top_k": 3},
    "top_p": {"temperature": 1.0, "top_p": 0.7},
    "min_p": {"temperature": 1.0, "min_p": 0.15},
    "penalties": {"temperature": 0.8, "presence_penalty": 0.7, "frequency_penalty": 0.4,
                  "repetition_penalty": 1.5},
    "all": {"temperature": 1.3, "top_k": 5, "top_p": 0.9, "min_p": 0.05,
            "repetition_penalty": 1.2, "frequency_penalty": 0.5},
    # Claims q = p for drafts drawn from q: every draft is accepted. The test must catch it.
    "wrong_q": {"temperature": 1.0},
}
# chi2 critical values at p = 1e-3 by degrees of freedom, from scipy.stats.chi2.isf(1e-3, dof)
# (scipy 1.17), used when scipy is not installed; with scipy the table is checked against it.
# scipy.special.chdtri(dof, q) is chi2.isf(q, dof) without scipy.stats' 2 s import.
CHI2_CRITICAL = {2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 7: 24.322, 8: 26.124, 15: 37.697,
                 24: 51.179, 35: 66.619, 47: 82.720, 63: 103.442}


def _critical(dof: int) -> float:
    try:
        from scipy.special import chdtri
    except ImportError:
        assert dof in CHI2_CRITICAL, f"add chi2.isf(1e-3, {dof}) to CHI2_CRITICAL"
        return CHI2_CRITICAL[dof]
    value = float(chdtri(dof, 1e-3))
    assert dof not in CHI2_CRITICAL or abs(CHI2_CRITICAL[dof] - value) < 1e-3
    return value


def _chi_square(observed: np.ndarray, expected_p: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom; cells expected below 5 draws are pooled,
    and a draw in a cell of probability 0 fails at once."""
    observed, expected = observed.ravel(), expected_p.ravel() * observed.sum()
    assert observed[expected == 0].sum() == 0, "a draw the target cannot make"
    small = (expected > 0) & (expected < 5)
    big = expected >= 5
    obs = np.append(observed[big], observed[small].sum())
    exp = np.append(expected[big], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def _reference(logits: np.ndarray, row: dict, counts: np.ndarray, mask: np.ndarray):
    """The numpy oracle of a row's full transform: [V] logits -> [V] float64 probabilities."""
    pen = _reference_penalties(
        logits[None], counts[None], mask[None], [row.get("presence_penalty", 0.0)],
        [row.get("frequency_penalty", 0.0)], [row.get("repetition_penalty", 1.0)])[0]
    scaled = (pen - pen.max()) / row["temperature"]
    keep, ambiguous = _reference_mask(
        scaled, row.get("top_k", 0), row.get("top_p", 1.0), row.get("min_p", 0.0))
    assert not ambiguous.any()
    w = np.where(keep, np.exp(scaled), 0.0)
    return w / w.sum()


@jax.jit
def _round(target, drafted, arrays, counts, mask, steps, wrong_q, claimed):
    """One speculative round on the device: DIST_K drafts from `drafted` [DIST_K, V] logits,
    verified against `target` [DIST_K + 1, V]; rows in `wrong_q` pass `claimed` [DIST_K, V] as
    their draft probs instead of the draft's own."""
    b = counts.shape[0]
    seen, drafts, probs = counts, [], []
    for j in range(DIST_K):
        d = draft_token(jnp.broadcast_to(drafted[j], (b, V)), arrays, seen, mask, steps + j)
        drafts.append(d.tokens)
        probs.append(jnp.where(wrong_q[:, None], claimed[j], d.probs))
        seen = count_tokens(seen, d.tokens, jnp.ones(b, bool))
    return accept(jnp.broadcast_to(target, (b, *target.shape)), jnp.stack(drafts, 1),
                  jnp.stack(probs, 1), arrays, counts, mask, steps,
                  jnp.full(b, DIST_K + 1, jnp.int32))


def test_committed_tokens_follow_non_speculative_sampling():
    rng = np.random.default_rng(3)
    # Logits by absolute position, each a shuffle of one profile; the draft model's profile is
    # flatter and shuffled apart, so p != q and the filters cut inside both.
    target_p = np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02])
    draft_p = np.array([0.25, 0.20, 0.15, 0.10, 0.10, 0.10, 0.05, 0.05])
    target = np.log([rng.permutation(target_p) for _ in range(DIST_K + 2)]).astype(np.float32)
    drafted = np.log([rng.permutation(draft_p) for _ in range(DIST_K + 1)]).astype(np.float32)
    counts0 = np.zeros(V, np.int32)
    counts0[[1, 6]] = [2, 1]
    mask0 = np.zeros(V, bool)
    mask0[[0, 6]] = True
    names = list(GROUPS)
    group = np.repeat(np.arange(len(names)), N)
    per_group = sampling_arrays([dict(GROUPS[n], seed=0) for n in names])
    arrays = dataclasses.replace(jax.tree.map(lambda x: np.repeat(x, N, axis=0), per_group),
                                 seed=np.arange(len(group), dtype=np.uint32) * 7919 + 11)
    counts = np.tile(counts0, (len(group), 1))
    mask = np.tile(mask0, (len(group), 1))
    steps = np.full(len(group), 40, np.int32)
    wrong_q = group == names.index("wrong_q")
    plain = GROUPS["plain"]
    claimed = np.array([_reference(target[j], plain, counts0, mask0) for j in range(DIST_K + 1)],
                       np.float32)

    first = _round(target[:-1], drafted[:-1], arrays, counts, mask, steps, wrong_q, claimed[:-1])
    t0 = np.asarray(first.tokens[:, 0])
    assert np.asarray(first.num).min() >= 1 and (np.asarray(first.num) == 1).any()
    # A row that committed one token continues with the next round, as decoding would.
    after = counts.copy()
    after[np.arange(len(group)), t0] += 1
    second = _round(target[1:], drafted[1:], arrays, after, mask, steps + 1, wrong_q, claimed[1:])
    t1 = np.where(np.asarray(first.num) >= 2, np.asarray(first.tokens[:, 1]),
                  np.asarray(second.tokens[:, 0]))

    results = {}
    for g, name in enumerate(names):
        row = GROUPS[name]
        p0 = _reference(target[0], row, counts0, mask0)
        p1 = np.stack([_reference(target[1], row, counts0 + (np.arange(V) == t), mask0)
                       for t in range(V)])  # p1[t0] given the first token
        sel = group == g
        hist0 = np.bincount(t0[sel], minlength=V)
        pairs = np.bincount(t0[sel] * V + t1[sel], minlength=V * V)
        results[name] = [_chi_square(hist0, p0), _chi_square(pairs, p0[:, None] * p1)]
    for name, tests in results.items():
        for what, (stat, dof) in zip(("first token", "pair"), tests):
            passes = stat < _critical(dof)
            assert passes == (name != "wrong_q"), (name, what, stat, dof, _critical(dof))
