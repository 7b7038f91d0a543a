"""Shared contexts and packed rows score exactly what each request scores alone.

Requests with the same context tokens (lm-eval's N choices of one question) run the context once
and every continuation from its state; short windows share a row as segments. Both are checked
against the plain core (every window alone in its row, proven against transformers in
test_scores) on the dense and MoE fixtures, with the calls the program received.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ninfer_jax.scoring import ScoreRequest
from ninfer_jax.scoring.core import SharedKey, WindowKey
from tests.models.conftest import rel_err
from tests.scoring.conftest import ROWS, WIDTH, core

TOL = 1e-5
SHARED = SharedKey(1, WIDTH, 4, WIDTH // 2)


def _spy(monkeypatch, c):
    """Records (kind, inputs) of every program call."""
    calls = []
    for name in ("score_windows", "score_shared"):
        real = getattr(c.program, name)

        def spy(key, inputs, real=real, name=name):
            calls.append((name, key, inputs))
            return real(key, inputs)

        monkeypatch.setattr(c.program, name, spy)
    return calls


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.logprobs.shape == w.logprobs.shape
        assert rel_err(g.logprobs, w.logprobs) <= TOL
        np.testing.assert_array_equal(g.is_greedy, w.is_greedy)


def _choices(rng, contexts, choices, cont_lens):
    """Requests: for each context length, `choices` continuations of random lengths."""
    requests = []
    for n in contexts:
        context = rng.integers(0, 320, n)
        for _ in range(choices):
            cont = rng.integers(0, 320, int(rng.choice(cont_lens)))
            requests.append(ScoreRequest(np.concatenate([context, cont]), n))
    return requests


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_choices_of_shared_contexts_score_as_each_pair_alone(name, monkeypatch):
    """Contexts of 20..30 tokens with four choices of 1..10 targets (some of a single token),
    one with six choices (a slot's four rows are not enough: it continues in a second slot);
    scored as windows instead: a lone pair, a pair whose continuation is longer than the
    shared rows (21 targets) and two choices of a context shorter than a row (5 tokens). Every
    score equals the plain core's; every shared context ran once per slot."""
    rng = np.random.default_rng(0)
    requests = _choices(rng, [20, 21, 25, 30], 4, [1, 3, 10])
    requests += _choices(rng, [22], 6, [2, 5])
    lone = rng.integers(0, 320, 30)
    requests.append(ScoreRequest(lone, 12))  # the only request with this context
    long_cont = rng.integers(0, 320, 21)
    requests.append(ScoreRequest(np.concatenate([requests[0].token_ids[:20], long_cont]), 20))
    requests += _choices(rng, [5], 2, [4])
    plain = core(name, plain=True).score(requests)
    c = core(name)
    calls = _spy(monkeypatch, c)
    got = c.score(requests)
    _assert_same(got, plain)
    shared = [inputs for kind, _, inputs in calls if kind == "score_shared"]
    # 4 x 4 + 6 continuations in rows of 4: six slots, one slot per call
    assert all(k == SHARED for kind, k, _ in calls if kind == "score_shared")
    assert sorted(int(x.context_len[0]) for x in shared) == [20, 21, 22, 22, 25, 30]
    assert sum(int(x.target_mask.any(1).sum()) for x in shared) == 22
    windows = [inputs for kind, _, inputs in calls if kind == "score_windows"]
    assert sum(int(x.segment_ids[r, n - 1]) + 1 for x in windows
               for r, n in enumerate(x.num_valid) if n) == 4  # lone, long, two short


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_short_texts_packed_in_a_row_score_as_each_alone(name, monkeypatch):
    """Texts of 2..21 tokens (windows of 1..20; many share their first token, a context too
    short to share) share rows as segments; every score equals the plain
    core's and the rows are as few as the tokens need."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(2, 22, 30)
    requests = [ScoreRequest(rng.integers(0, 320, n), 1) for n in lengths]
    plain = core(name, plain=True).score(requests)
    c = core(name)
    calls = _spy(monkeypatch, c)
    before = c.occupancy
    got = c.score(requests)
    _assert_same(got, plain)
    assert {kind for kind, _, _ in calls} == {"score_windows"}  # no context to share
    rows = [(x.segment_ids[r], x.num_valid[r]) for _, _, x in calls for r in range(ROWS)]
    used = [(seg, n) for seg, n in rows if n > 0]
    assert sum(int(n) for _, n in used) == int(np.sum(lengths - 1))
    assert max(int(seg[n - 1]) for seg, n in used) >= 2  # three or more texts in a row
    assert len(used) == -(-int(np.sum(lengths - 1)) // WIDTH)  # the fewest rows that hold them
    delta = c.occupancy
    assert delta.tokens - before.tokens == int(np.sum(lengths - 1))
    assert delta.slots - before.slots == len(calls) * ROWS * WIDTH


def test_windows_that_do_not_fit_together_keep_a_row_each_and_sharing_can_be_off():
    """Windows of more than half the pack length keep a row each; with pack and
    share_contexts off the core compiles only its window shapes."""
    rng = np.random.default_rng(2)
    requests = [ScoreRequest(rng.integers(0, 320, 30), 1) for _ in range(4)]
    c = core("dense")
    before = c.occupancy
    c.score(requests)
    assert c.occupancy.slots - before.slots == 2 * ROWS * WIDTH  # four rows: two calls
    assert core("dense", plain=True).keys() == [WindowKey(ROWS, WIDTH)]


def test_the_tail_of_packed_rows_runs_in_quarter_calls():
    """Full calls first; the rest in quarter-size calls when they take fewer rows than one
    more full call (a batch's last call is not mostly filler)."""
    from ninfer_jax.scoring import ScoringConfig
    from ninfer_jax.scoring.core import _calls
    from tests.models.conftest import loaded

    rows = list(range(37))
    assert [(n, len(b)) for n, b in _calls(rows, [16, 4])] == [(16, 16), (16, 16), (4, 4),
                                                               (4, 1)]
    assert [(n, len(b)) for n, b in _calls(rows[:29], [16, 4])] == [(16, 16), (16, 13)]
    assert [(n, len(b)) for n, b in _calls(rows[:5], [16])] == [(16, 5)]
    cfg = dataclasses.replace(loaded("dense").config, max_position_embeddings=4096)
    assert ScoringConfig().window_keys(cfg)[-1] == WindowKey(8, 128)
    assert ScoringConfig(pack=False).window_keys(cfg)[-1] == WindowKey(2, 2048)
    assert ScoringConfig(max_len=WIDTH, max_batch_tokens=ROWS * WIDTH).window_keys(cfg) == [
        WindowKey(ROWS, WIDTH)]  # fewer than four rows a call: no tail call


@pytest.mark.parametrize("field,value,match", [
    ("pack", "yes", "pack must be true or false"),
    ("share_contexts", 1, "share_contexts must be true or false"),
    ("max_continuation", 0, "max_continuation must be an integer >= 1"),
    ("max_batch_tokens", True, "max_batch_tokens must be an integer >= 1"),
])
def test_bad_scoring_settings_name_the_field(field, value, match):
    from ninfer_jax.errors import ConfigError
    from ninfer_jax.scoring import ScoringConfig

    with pytest.raises(ConfigError, match=match):
        ScoringConfig(**{field: value})


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_a_scanned_layer_loop_scores_as_the_unrolled_one(name, monkeypatch):
    """On CPU a ScoringProgram runs its layers unrolled over per-layer weights
    (`platform_defaults`); the scan over stacked weights (TPU's loop) gives the same packed and
    shared scores. An unknown loop is refused by name."""
    from ninfer_jax.errors import ConfigError
    from ninfer_jax.program.scoring import ScoringProgram
    from tests.models.conftest import loaded

    rng = np.random.default_rng(3)
    requests = _choices(rng, [20, 24], 4, [1, 6])  # shared contexts
    requests += [ScoreRequest(rng.integers(0, 320, n), 1) for n in (3, 9, 17, 30)]  # packed
    c = core(name)
    assert c.program.layer_loop == "unrolled" and "layers" in c.program.params
    unrolled = c.score(requests)
    m = loaded(name)
    scan = ScoringProgram(m.config, m.params, c.program.keys(), layer_loop="scan")
    assert "layers" not in scan.params
    monkeypatch.setattr(c, "program", scan)
    calls = _spy(monkeypatch, c)
    _assert_same(c.score(requests), unrolled)
    assert {kind for kind, _, _ in calls} == {"score_windows", "score_shared"}
    with pytest.raises(ConfigError, match="layer_loop must be one of"):
        ScoringProgram(m.config, m.params, c.program.keys(), layer_loop="loop")
