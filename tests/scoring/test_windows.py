"""Window plans against lm-evaluation-harness's own window functions, and their invariants."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ninfer_jax.scoring import Window, rolling_windows
from tests.scoring.lm_eval_windows import FIXTURE, cases, lm_eval_spans


def as_lm_eval(windows: list[Window]) -> list[list[list[int]]]:
    """Our windows in the fixture's form: the model reads (context + prediction)[:-1]."""
    out = []
    for w in windows:
        context = [w.start, w.first_target] if w.start < w.first_target else [0, 0]
        out.append([context, [w.first_target, w.end + 1]])
    return out


def test_spans_match_the_committed_lm_eval_fixture():
    data = json.loads(FIXTURE.read_text())
    assert len(data) == len(cases())
    for case in data:
        got = rolling_windows(case["num_tokens"] + 1, 1, case["window"], case["stride"])
        assert as_lm_eval(got) == case["spans"], case


def test_spans_match_lm_eval_on_random_lengths():
    rng = np.random.default_rng(1)
    for _ in range(500):
        window = int(rng.integers(1, 300))
        stride = int(rng.integers(1, window + 1))
        n = int(rng.integers(0, 5 * window))
        assert as_lm_eval(rolling_windows(n + 1, 1, window, stride)) == \
            lm_eval_spans(n, window, stride), (n, window, stride)


def test_single_window_with_context_is_lm_eval_loglikelihood_truncation():
    """lm-eval's loglikelihood reads (context + continuation)[-(max_length + 1):][:-1]."""
    rng = np.random.default_rng(2)
    for _ in range(300):
        window = int(rng.integers(1, 50))
        num_cont = int(rng.integers(1, window + 1))
        num_ctx = int(rng.integers(1, 3 * window))
        m = num_ctx + num_cont
        [w] = rolling_windows(m, num_ctx, window, stride=int(rng.integers(1, window + 1)))
        s = list(range(m))
        assert s[w.start:w.end] == s[-(window + 1):][:-1]
        assert (w.first_target, w.num_targets) == (num_ctx, num_cont)


@pytest.mark.parametrize("seed", range(5))
def test_targets_are_covered_once_and_windows_fit(seed):
    rng = np.random.default_rng(seed)
    for _ in range(200):
        window = int(rng.integers(1, 40))
        stride = int(rng.integers(1, window + 1))
        first = int(rng.integers(1, 30))
        m = int(rng.integers(0, 200))
        windows = rolling_windows(m, first, window, stride)
        scored = [t for w in windows for t in range(w.first_target, w.end + 1)]
        assert scored == list(range(first, m))
        for i, w in enumerate(windows):
            assert 0 <= w.start < w.end <= m - 1 and w.length <= window
            assert w.num_targets <= (window if i == 0 else stride) and w.num_targets <= w.length
            assert w.length == min(window, w.end)  # as much carried context as fits


@pytest.mark.parametrize("window,stride,first", [(0, None, 1), (4, 5, 1), (4, 0, 1), (4, 2, 0)])
def test_bad_plans_are_refused(window, stride, first):
    with pytest.raises(ValueError):
        rolling_windows(10, first, window, stride)
