"""Sampling: greedy, filter sets against a numpy reference (ties included), the top-p and min-p
boundaries at exactly equal mass (probabilities exact in float32), draw frequencies,
penalties against OpenAI's and Hugging Face's formulas, batch invariance, seed/step streams, one
compilation for mixed rows, and validation of bad settings."""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer_jax.program.sampling import (
    SamplingArrays,
    apply_penalties,
    count_tokens,
    init_penalty_state,
    mark_prompt_tokens,
    sample,
    sampling_arrays,
    truncation_mask,
)
from ninfer_jax.sampling_params import SamplingParams, SamplingParamsError


@contextlib.contextmanager
def traced():
    """The jaxpr traces (new jit specialisations) that happen while the block runs."""
    traces: list[str] = []

    def listener(name: str, secs: float, **kwargs) -> None:
        if name.endswith("jaxpr_trace_duration"):
            traces.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield traces
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)

V = 64  # vocab of the small tests; one shape, so each jitted function compiles once per B


def _step(logits, arrays, output_counts, prompt_mask, step_index):
    return sample(apply_penalties(logits, arrays, output_counts, prompt_mask), arrays, step_index)


step = jax.jit(_step)
jit_sample = jax.jit(sample, static_argnames="candidates")
jit_mask = jax.jit(truncation_mask, static_argnames="candidates")
# Candidate counts: every token (top-k / top-p always settled among them), and a few, so rows
# whose kept set is wider take the full sort and draw over the whole vocabulary.
CANDIDATE_COUNTS = [V, 6]


def _rows(n: int, **settings_) -> SamplingArrays:
    return sampling_arrays([dict(settings_) for _ in range(n)])


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax_with_ties_to_lowest_id():
    rng = np.random.default_rng(0)
    logits = rng.integers(-3, 3, (8, V)).astype(np.float32)  # many ties for the max
    logits[0, [5, 9]] = 10.0
    # Filters and seeds are ignored by greedy rows.
    arrays = sampling_arrays(
        [{"temperature": 0.0, "top_k": 3, "top_p": 0.2, "min_p": 0.9, "seed": i} for i in range(8)]
    )
    out = jit_sample(logits, arrays, np.arange(8, dtype=np.int32))
    np.testing.assert_array_equal(out.tokens, np.argmax(logits, axis=-1))
    assert out.tokens[0] == 5
    log_softmax = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(out.logprobs, log_softmax[np.arange(8), out.tokens], atol=1e-5)


def test_temperature_zero_is_greedy_and_a_tiny_temperature_agrees_without_nan():
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((4, V)) * 50).astype(np.float32)
    expected = np.argmax(logits, axis=-1)
    for seed in (0, 7, 2**32 - 1):
        greedy = jit_sample(logits, _rows(4, temperature=0.0, seed=seed), np.full(4, 3, np.int32))
        np.testing.assert_array_equal(greedy.tokens, expected)
    tiny = jit_sample(logits, _rows(4, temperature=1e-30, seed=1), np.zeros(4, np.int32))
    np.testing.assert_array_equal(tiny.tokens, expected)
    assert np.isfinite(np.asarray(tiny.logprobs)).all()


# ---------------------------------------------------------------- filter sets


def _reference_mask(scaled: np.ndarray, top_k: int, top_p: float, min_p: float):
    """Kept set per the module's definition, in float64, plus the tokens too close to a top-p
    or min-p boundary for float32 to decide (excluded from the comparison)."""
    v = scaled.astype(np.float64)
    keep = np.ones(v.shape, bool)
    if top_k > 0:
        keep &= v >= np.sort(v)[::-1][min(top_k, v.size) - 1]
    p = np.where(keep, np.exp(v - v.max()), 0.0)
    p /= p.sum()
    mass_greater = np.array([p[v > x].sum() for x in v])
    ambiguous = np.zeros(v.shape, bool)
    if top_p < 1:
        keep &= mass_greater < top_p
        ambiguous |= np.abs(mass_greater - top_p) < 1e-5
    ratio = np.exp(v - v.max())
    keep &= ratio >= min_p
    ambiguous |= np.abs(ratio - min_p) < 1e-6
    return keep, ambiguous


@pytest.mark.parametrize("candidates", CANDIDATE_COUNTS)
@pytest.mark.parametrize("tied", [False, True])
def test_truncation_sets_match_numpy_reference(tied, candidates):
    rng = np.random.default_rng(2 + tied)
    b = 8
    for _ in range(6):
        if tied:  # coarse grid: ties at every boundary
            scaled = rng.integers(-12, 1, (b, V)).astype(np.float32) / 2
        else:
            scaled = rng.standard_normal((b, V)).astype(np.float32) * 2
        scaled -= scaled.max(-1, keepdims=True)
        top_k = rng.choice([0, 1, 2, 5, 17, V, V + 3], b)
        top_p = rng.choice([1.0, 0.95, 0.8, 0.5, 0.3, 0.05], b)
        min_p = rng.choice([0.0, 0.0, 0.02, 0.1, 0.5, 1.0], b)
        arrays = sampling_arrays(
            [
                {"top_k": int(k), "top_p": float(p), "min_p": float(m), "seed": 0}
                for k, p, m in zip(top_k, top_p, min_p)
            ]
        )
        got = np.asarray(jit_mask(scaled, arrays, candidates=candidates))
        for r in range(b):
            want, ambiguous = _reference_mask(scaled[r], top_k[r], top_p[r], min_p[r])
            np.testing.assert_array_equal(got[r][~ambiguous], want[~ambiguous])
            assert got[r][np.argmax(scaled[r])]  # the top token always stays


@pytest.mark.parametrize("candidates", [V, 2])
def test_boundary_ties_are_kept_together(candidates):
    probs = np.array([0.4, 0.2, 0.2, 0.1, 0.1] + [0.0] * 3)
    scaled = np.log(np.maximum(probs, 1e-30)).astype(np.float32)[None]
    scaled -= scaled.max()
    cases = [  # (top_k, top_p, min_p) -> kept ids
        ((2, 1.0, 0.0), [0, 1, 2]),  # the 2nd largest is tied: both kept
        ((4, 1.0, 0.0), [0, 1, 2, 3, 4]),
        ((0, 0.5, 0.0), [0, 1, 2]),  # mass above the 0.2s is 0.4 < 0.5: both 0.2s kept
        ((0, 0.3, 0.0), [0]),
        ((0, 0.85, 0.0), [0, 1, 2, 3, 4]),
        ((0, 1.0, 0.4), [0, 1, 2]),  # 0.2 >= 0.4 * 0.4
        ((2, 0.45, 0.0), [0]),  # renormalised top-k set: 0.5, 0.25, 0.25, so the 0.25s go
        ((2, 0.55, 0.0), [0, 1, 2]),
        ((1, 1.0, 0.0), [0]),
    ]
    for (k, p, m), kept in cases:
        arrays = sampling_arrays([{"top_k": k, "top_p": p, "min_p": m, "seed": 0}])
        got = np.flatnonzero(np.asarray(jit_mask(scaled, arrays, candidates=candidates))[0])
        assert got.tolist() == kept, (k, p, m)


def _exact_row(probs: list[float]) -> np.ndarray:
    """Tempered logits [1, V] (row max 0) whose softmax is exactly `probs` (powers of two), in
    a shuffled vocab order; the rest of the vocab gets probability exactly 0."""
    want = np.zeros(V)
    want[: len(probs)] = probs
    order = np.random.default_rng(7).permutation(V)
    want = want[order][None]
    ratios = want / want.max()
    scaled = np.where(ratios > 0, np.log(np.maximum(ratios, 1e-300)), -200.0).astype(np.float32)
    # The premise: float32 computes these probabilities exactly, so equal mass is equality.
    np.testing.assert_array_equal(np.asarray(jax.nn.softmax(jnp.asarray(scaled))), want)
    return scaled


def _kept_probs(scaled: np.ndarray, **row) -> list[float]:
    mask = np.asarray(jit_mask(scaled, sampling_arrays([{"seed": 0, **row}])))[0]
    p = np.asarray(jax.nn.softmax(jnp.asarray(scaled)))[0]
    return sorted(p[mask].tolist(), reverse=True)


def test_top_p_boundary_at_exactly_equal_mass():
    """Smallest set whose mass >= top_p; equal mass completes the set; boundary ties stay."""
    up, down = np.nextafter(np.float32(0.5), 1), np.nextafter(np.float32(0.5), 0)
    row = _exact_row([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 16])
    all5 = [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 16]
    cases = [
        (0.5, [1 / 2]),  # the top token's mass is exactly 0.5: nothing else
        (float(down), [1 / 2]),
        (float(up), [1 / 2, 1 / 4]),
        (0.75, [1 / 2, 1 / 4]),
        (0.875, [1 / 2, 1 / 4, 1 / 8]),
        (float(np.nextafter(np.float32(0.875), 1)), all5),  # one 1/16 needed: its twin stays
        (0.9375, all5),
    ]
    for top_p, kept in cases:
        assert _kept_probs(row, top_p=top_p) == kept, top_p
    assert len(_kept_probs(row, top_p=1.0)) == V  # off: the zero-probability tokens too

    ties = _exact_row([1 / 4, 1 / 4, 1 / 4, 1 / 8, 1 / 8])
    for top_p, kept in [(0.25, [1 / 4] * 3), (0.75, [1 / 4] * 3),
                        (float(np.nextafter(np.float32(0.75), 1)), [1 / 4] * 3 + [1 / 8] * 2)]:
        assert _kept_probs(ties, top_p=top_p) == kept, top_p


def test_min_p_boundary_keeps_equal_ratio():
    row = _exact_row([1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 16])
    assert _kept_probs(row, min_p=0.25) == [1 / 2, 1 / 4, 1 / 8]  # 1/8 == 0.25 * 1/2
    assert _kept_probs(row, min_p=float(np.nextafter(np.float32(0.25), 1))) == [1 / 2, 1 / 4]


def test_skipping_the_sort_keeps_the_same_set_and_token():
    """A batch whose rows set neither top-k nor top-p skips the sort; a row gets the same set
    and token as in a batch that sorts."""
    rng = np.random.default_rng(6)
    logits = (rng.standard_normal((2, V)) * 2).astype(np.float32)
    plain = {"temperature": 0.9, "min_p": 0.05, "seed": 11}
    alone = sampling_arrays([plain, plain])
    mixed = sampling_arrays([plain, {"temperature": 0.9, "top_k": 3, "top_p": 0.5, "seed": 2}])
    scaled = logits - logits.max(-1, keepdims=True)
    np.testing.assert_array_equal(jit_mask(scaled, alone)[0], jit_mask(scaled, mixed)[0])
    steps = np.arange(2, dtype=np.int32)
    for s in range(20):
        a = jit_sample(logits, alone, steps + s)
        b = jit_sample(logits, mixed, steps + s)
        assert int(a.tokens[0]) == int(b.tokens[0])
        assert float(a.logprobs[0]) == float(b.logprobs[0])


def test_candidates_and_full_vocabulary_draw_the_same_token():
    """Top-k/top-p settled among a few candidates (and the draw taken over them) or over the
    whole vocabulary: the same kept set and the same token, row by row, in any batch."""
    rng = np.random.default_rng(8)
    b = 8
    rows = [{"temperature": 0.7, "top_p": 0.5, "seed": 1},  # narrow: settled by candidates
            {"temperature": 1.0, "top_k": 3, "seed": 2},
            {"temperature": 1.0, "top_p": 0.99, "seed": 3},  # wide: the sort and the vocabulary
            {"temperature": 0.8, "min_p": 0.3, "seed": 4},  # min-p drops the last candidate
            {"temperature": 1.2, "seed": 5},  # nothing filters: the vocabulary
            {"temperature": 0.0},
            {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "seed": 6},  # top-k above them
            {"temperature": 0.5, "top_k": 2, "top_p": 0.3, "min_p": 0.1, "seed": 7}]
    arrays = sampling_arrays(rows)
    narrow = sampling_arrays([rows[0], rows[1], rows[3], rows[5]] * 2)
    for trial in range(10):
        logits = (rng.standard_normal((b, V)) * rng.choice([1.0, 4.0])).astype(np.float32)
        steps = np.arange(b, dtype=np.int32) + 10 * trial
        scaled = np.asarray(jax.vmap(lambda r, t: (r - r.max()) / jnp.where(t > 0, t, 1.0))(
            logits, arrays.temperature))
        full = np.asarray(jit_mask(scaled, arrays, candidates=V))
        few = np.asarray(jit_mask(scaled, arrays, candidates=4))
        np.testing.assert_array_equal(few, full)
        want = np.asarray(jit_sample(logits, arrays, steps, candidates=V).tokens)
        got = np.asarray(jit_sample(logits, arrays, steps, candidates=4).tokens)
        np.testing.assert_array_equal(got, want)
        # A batch whose sampled rows all keep fewer than the candidates draws over them only.
        idx = [0, 1, 3, 5, 0, 1, 3, 5]
        alone = np.asarray(jit_sample(logits[idx], narrow, steps[idx], candidates=4).tokens)
        np.testing.assert_array_equal(alone, want[idx])


# ---------------------------------------------------------------- draw frequencies


@pytest.mark.parametrize(
    "row",
    [
        {"temperature": 1.0},
        {"temperature": 0.6},
        {"temperature": 1.5, "top_k": 4},
        {"temperature": 1.0, "top_p": 0.7},
        {"temperature": 0.9, "min_p": 0.2},
        {"temperature": 1.3, "top_k": 6, "top_p": 0.9, "min_p": 0.05},
    ],
)
@pytest.mark.parametrize("candidates", [8, 3])
def test_draw_frequencies_match_the_filtered_distribution(row, candidates):
    n, vocab = 20000, 8
    logits = np.array([2.0, 1.5, 1.2, 1.0, 0.3, 0.0, -0.5, -2.0], np.float32)
    arrays = sampling_arrays([dict(row, seed=1234)] * n)
    # One request's stream: n consecutive steps of the same seed.
    out = jit_sample(np.broadcast_to(logits, (n, vocab)), arrays, np.arange(n, dtype=np.int32),
                     candidates=candidates)
    scaled = (logits - logits.max()) / row["temperature"]
    keep, ambiguous = _reference_mask(
        scaled, row.get("top_k", 0), row.get("top_p", 1.0), row.get("min_p", 0.0)
    )
    assert not ambiguous.any()
    expected = np.where(keep, np.exp(scaled.astype(np.float64)), 0.0)
    expected /= expected.sum()
    freq = np.bincount(np.asarray(out.tokens), minlength=vocab) / n
    assert (freq[~keep] == 0).all()
    # 6 standard deviations of a frequency (sd <= 0.5 / sqrt(n) = 0.0035); seeds are fixed.
    assert np.abs(freq - expected).max() < 0.021, (freq, expected)


# ---------------------------------------------------------------- penalties


def _reference_penalties(logits, counts, prompt_mask, presence, frequency, repetition):
    out = logits.astype(np.float64).copy()
    for r in range(out.shape[0]):
        for t in range(out.shape[1]):
            if prompt_mask[r, t] or counts[r, t] > 0:  # Hugging Face repetition penalty
                x = out[r, t]
                out[r, t] = x * repetition[r] if x < 0 else x / repetition[r]
            # OpenAI presence / frequency, over generated tokens only
            out[r, t] -= frequency[r] * counts[r, t] + presence[r] * (counts[r, t] > 0)
    return out


def test_penalties_match_openai_and_hf_formulas():
    rng = np.random.default_rng(4)
    b = 6
    logits = (rng.standard_normal((b, V)) * 3).astype(np.float32)
    counts = np.where(rng.random((b, V)) < 0.3, rng.integers(1, 5, (b, V)), 0).astype(np.int32)
    prompt_mask = rng.random((b, V)) < 0.2
    presence = rng.uniform(-2, 2, b).astype(np.float32)
    frequency = rng.uniform(-2, 2, b).astype(np.float32)
    repetition = rng.uniform(0.5, 2.0, b).astype(np.float32)
    presence[0], frequency[0], repetition[0] = 0.0, 0.0, 1.0  # an all-off row
    arrays = sampling_arrays(
        [
            {
                "presence_penalty": float(p),
                "frequency_penalty": float(f),
                "repetition_penalty": float(r),
                "seed": 0,
            }
            for p, f, r in zip(presence, frequency, repetition)
        ]
    )
    got = np.asarray(jax.jit(apply_penalties)(logits, arrays, counts, prompt_mask))
    want = _reference_penalties(logits, counts, prompt_mask, presence, frequency, repetition)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[0], logits[0])  # off is bit-identical


def test_penalty_state_prompt_mask_and_commit_counts():
    prompt_ids = np.array([[3, 5, 3, 0], [7, 0, 0, 0], [0, 0, 0, 0]], np.int32)  # right-padded
    counts, prompt_mask = init_penalty_state(prompt_ids, np.array([3, 1, 0], np.int32), V)
    assert counts.shape == (3, V) and counts.dtype == jnp.int32 and not np.asarray(counts).any()
    assert [np.flatnonzero(m).tolist() for m in np.asarray(prompt_mask)] == [[3, 5], [7], []]
    # A later chunk adds to the mask; padding (valid False) adds nothing.
    chunk = np.array([[9, 1], [2, 2], [4, 6]], np.int32)
    valid = np.array([[True, False], [True, True], [False, False]])
    prompt_mask = mark_prompt_tokens(prompt_mask, chunk, valid)
    assert [np.flatnonzero(m).tolist() for m in np.asarray(prompt_mask)] == [[3, 5, 9], [2, 7], []]
    counts = count_tokens(counts, np.array([4, 4, 4], np.int32), np.array([True, False, True]))
    counts = count_tokens(counts, np.array([4, 8, 4], np.int32), np.array([True, True, True]))
    c = np.asarray(counts)
    assert c[0, 4] == 2 and c[1, 4] == 0 and c[1, 8] == 1 and c[2, 4] == 2 and c.sum() == 5


# ---------------------------------------------------------------- batch invariance, streams

_row_settings = st.fixed_dictionaries(
    {
        "temperature": st.sampled_from([0.0, 0.3, 0.7, 1.0, 1.8]),
        "top_k": st.sampled_from([0, 1, 3, 20]),
        "top_p": st.sampled_from([1.0, 0.9, 0.5]),
        "min_p": st.sampled_from([0.0, 0.05, 0.3]),
        "presence_penalty": st.sampled_from([0.0, 1.0, -0.5]),
        "frequency_penalty": st.sampled_from([0.0, 0.4]),
        "repetition_penalty": st.sampled_from([1.0, 1.2, 0.8]),
        "seed": st.integers(0, 2**32 - 1),
    }
)


def _random_rows(rng: np.random.Generator, n: int):
    logits = (rng.standard_normal((n, V)) * 2).astype(np.float32)
    counts = np.where(rng.random((n, V)) < 0.1, rng.integers(1, 4, (n, V)), 0).astype(np.int32)
    return logits, counts, rng.random((n, V)) < 0.1, rng.integers(0, 10_000, n).astype(np.int32)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    row=_row_settings,
    neighbours=st.lists(_row_settings, min_size=7, max_size=7),
    data_seed=st.integers(0, 2**31),
    where=st.integers(0, 7),
)
def test_a_row_gets_the_same_token_in_any_batch(row, neighbours, data_seed, where):
    rng = np.random.default_rng(data_seed)
    logits, counts, mask, steps = _random_rows(rng, 8)
    results = []
    for b in (1, 3, 8):
        at = where % b
        idx = [i for i in range(1, b)]
        idx.insert(at, 0)  # row 0's data sits at position `at` among b - 1 neighbours
        rows = [row if i == 0 else neighbours[i - 1] for i in idx]
        out = step(logits[idx], sampling_arrays(rows), counts[idx], mask[idx], steps[idx])
        results.append((int(out.tokens[at]), float(out.logprobs[at])))
    assert results[0] == results[1] == results[2]


def test_same_seed_and_step_repeat_and_steps_give_a_stream():
    logits = np.zeros((64, V), np.float32)  # uniform: every token equally likely
    steps = np.arange(64, dtype=np.int32)
    a = jit_sample(logits, _rows(64, temperature=1.0, seed=42), steps).tokens
    again = jit_sample(logits, _rows(64, temperature=1.0, seed=42), steps).tokens
    other = jit_sample(logits, _rows(64, temperature=1.0, seed=43), steps).tokens
    np.testing.assert_array_equal(a, again)  # an aborted step, retried, draws the same token
    assert len(set(np.asarray(a).tolist())) > 30  # steps are distinct draws, not one repeated
    assert (np.asarray(a) != np.asarray(other)).sum() > 50


# ---------------------------------------------------------------- one executable


def test_mixed_batch_compiles_once():
    fn = jax.jit(lambda *args: _step(*args))  # its own cache, not shared with `step`
    logits = np.zeros((4, V), np.float32)
    logits[:, 10], logits[:, 11] = 5.0, 4.0
    counts = np.zeros((4, V), np.int32)
    counts[1, 10] = 1  # row 1 has generated token 10 already
    mask = np.zeros((4, V), bool)
    rows = [
        {"temperature": 0.0},  # greedy
        {"temperature": 0.0, "presence_penalty": 2.0, "frequency_penalty": 0.5},  # penalised
        {"temperature": 0.8, "top_k": 5, "top_p": 0.9, "seed": 3},  # sampled
        {"temperature": 1.2, "min_p": 0.1, "repetition_penalty": 1.3, "seed": 4},  # both
    ]
    swapped = [{"temperature": 0.5, "top_k": 1, "seed": 9}, rows[3], rows[0], rows[1]]
    calls = [  # numpy and device arrays, every row's settings changed: all one executable
        (logits, sampling_arrays(rows), counts, mask, np.zeros(4, np.int32)),
        (logits * 2, sampling_arrays(swapped), counts + 1, ~mask, np.full(4, 7, np.int32)),
        jax.device_put((logits, sampling_arrays(rows), counts, mask, np.ones(4, np.int32))),
    ]
    with traced() as traces:
        outs = [fn(*args) for args in calls]
    assert len(traces) == 1
    assert outs[0].tokens.tolist()[:2] == [10, 11]  # row 1: 5 - 2 - 0.5 < 4
    assert outs[2].tokens.tolist()[:2] == [10, 11]


def test_full_vocab_batch_of_eight_runs():
    vocab = 248_320
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((8, vocab)).astype(np.float32)
    rows = [{"temperature": 0.0}] + [
        {"temperature": 0.7, "top_k": 50, "top_p": 0.9, "min_p": 0.01, "seed": i} for i in range(7)
    ]
    out = jit_sample(logits, sampling_arrays(rows), np.zeros(8, np.int32))
    tokens = np.asarray(out.tokens)
    assert tokens[0] == np.argmax(logits[0])
    top50 = np.argsort(-logits[1:], axis=-1)[:, :50]
    assert all(t in top50[i] for i, t in enumerate(tokens[1:]))


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "field,value,range_text",
    [
        ("temperature", -0.1, ">= 0"),
        ("temperature", float("nan"), ">= 0"),
        ("temperature", float("inf"), ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_p", float("nan"), "(0, 1]"),
        ("top_p", 1e-50, "(0, 1]"),  # 0 as float32
        ("repetition_penalty", 1e39, "> 0"),  # inf as float32
        ("top_k", -1, "[0,"),
        ("top_k", 2.5, "integer"),
        ("top_k", True, "integer"),
        ("min_p", -0.1, "[0, 1]"),
        ("min_p", 1.1, "[0, 1]"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", float("inf"), "> 0"),
        ("presence_penalty", 2.5, "[-2, 2]"),
        ("frequency_penalty", float("-inf"), "[-2, 2]"),
        ("seed", -1, "[0, 4294967295]"),
        ("seed", 2**32, "[0, 4294967295]"),
        ("seed", 1.0, "integer"),
        ("temperature", "0.5", ">= 0"),
    ],
)
def test_bad_values_are_rejected_naming_the_field(field, value, range_text):
    good = {"temperature": 1.0, "seed": 1}
    with pytest.raises(SamplingParamsError) as e:
        sampling_arrays([good, dict(good, **{field: value})])
    assert "row 1" in str(e.value) and field in str(e.value) and range_text in str(e.value)


def test_structural_errors_and_accepted_row_kinds():
    with pytest.raises(SamplingParamsError, match="seed is required"):
        sampling_arrays([{"temperature": 0.7}])
    with pytest.raises(SamplingParamsError, match="unknown sampling field.*'top_q'"):
        sampling_arrays([{"top_q": 0.5, "seed": 1}])
    with pytest.raises(SamplingParamsError, match="at least one row"):
        sampling_arrays([])

    @dataclasses.dataclass
    class Request:  # a request-level dataclass carrying more than sampling settings
        temperature: float
        seed: int
        max_tokens: int

    arrays = sampling_arrays(
        [
            SamplingParams(temperature=0.0),
            Request(0.5, 2**32 - 1, 16),
            {"top_k": np.int64(3), "top_p": np.float32(0.5), "seed": np.uint32(7)},
        ]
    )
    assert arrays.temperature.tolist() == [0.0, 0.5, 1.0]
    assert arrays.seed.dtype == np.uint32 and arrays.seed.tolist() == [0, 2**32 - 1, 7]
    assert arrays.top_k.dtype == np.int32 and arrays.top_k.tolist() == [0, 0, 3]


def test_min_tokens_suppresses_stop_ids_until_reached():
    """Rows below their min_tokens (generated = the sum of their counts) get -inf at their stop
    ids and nothing else changes; rows at it, and rows with min_tokens 0, come back unchanged."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(3, V)), jnp.float32)
    counts = np.zeros((3, V), np.int32)
    counts[0, 5] = 2  # row 0 generated 2 tokens, row 1 generated 4, row 2 none
    counts[1, 7] = 4
    arrays = sampling_arrays([{"min_tokens": 3, "seed": 1}, {"min_tokens": 4, "seed": 1},
                              {"min_tokens": 0, "seed": 1}],
                             stop_ids=[(1, 9), (1, 9), (1, 9)], vocab_size=V)
    mask = jnp.zeros((3, V), bool)
    out = np.asarray(jax.jit(apply_penalties)(logits, arrays, jnp.asarray(counts), mask))
    want = np.asarray(logits).copy()
    want[0, [1, 9]] = -np.inf
    np.testing.assert_array_equal(out, want)
    none = sampling_arrays([{"seed": 1}] * 3, vocab_size=V)
    np.testing.assert_array_equal(
        np.asarray(jax.jit(apply_penalties)(logits, none, jnp.asarray(counts), mask)), logits)
    tokens = np.asarray(jit_sample(jnp.asarray(out), arrays, jnp.zeros(3, jnp.int32)).tokens)
    assert tokens[0] not in (1, 9)
