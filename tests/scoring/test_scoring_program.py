"""The CausalScoring purpose's Program: CausalScoreCore runs every window through its
ScoringProgram, one call after another, on shapes compiled at start-up only; the program refuses
a shape it never compiled and inputs that do not match their key, naming the field."""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from ninfer_jax.program.errors import MissingExecutableError
from ninfer_jax.program.scoring import ScoringProgram, SharedKey, WindowKey
from ninfer_jax.program.scoring_steps import WindowInputs
from ninfer_jax.scoring import ScoreRequest
from tests.models.conftest import loaded, reference
from tests.program.test_program import COUNTER
from tests.scoring.conftest import ROWS, WIDTH, core, transformers_logprobs


def _inputs(rows: int, length: int, **changes) -> WindowInputs:
    fields = dict(token_ids=np.zeros((rows, length), np.int32),
                  target_ids=np.zeros((rows, length), np.int32),
                  target_mask=np.zeros((rows, length), bool),
                  num_valid=np.zeros(rows, np.int32),
                  positions=np.tile(np.arange(length, dtype=np.int32), (rows, 1)),
                  segment_ids=np.zeros((rows, length), np.int32))
    return WindowInputs(**{**fields, **changes})


def test_the_core_runs_every_window_through_its_program_serially(monkeypatch):
    c = core("dense", window=WIDTH, stride=13)
    ids = reference("dense")["token_ids"]
    program, calls, active = c.program, [], []
    real = program.score_windows

    def spy(key, inputs):
        assert not active, "two scoring calls overlapped"
        active.append(key)
        try:
            calls.append((key, np.asarray(inputs.num_valid).copy()))
            return real(key, inputs)
        finally:
            active.pop()

    monkeypatch.setattr(program, "score_windows", spy)
    requests = [ScoreRequest(np.asarray(row, np.int32), 1) for row in ids.tolist()]
    windows = sum(len(c.plan(r)) for r in requests)
    COUNTER.active = True
    try:
        scores = c.score(requests)
    finally:
        COUNTER.active = False
    assert COUNTER.count == 0, "scoring compiled after start-up"
    assert len(calls) == -(-windows // ROWS) and all(k == WindowKey(ROWS, WIDTH)
                                                      for k, _ in calls)
    assert sum(int((nv > 0).sum()) for _, nv in calls) == windows  # filler rows only at the end
    want, _ = transformers_logprobs("dense")
    np.testing.assert_allclose(np.stack([s.logprobs for s in scores]), want, rtol=1e-5,
                               atol=1e-5)


def test_the_program_holds_exactly_its_compiled_shapes():
    c = core("dense")
    program = c.program
    shared = SharedKey(1, WIDTH, 4, WIDTH // 2)
    assert program.keys() == [WindowKey(ROWS, WIDTH), shared]
    assert set(program.compile_seconds) == {WindowKey(ROWS, WIDTH), shared}
    with pytest.raises(MissingExecutableError, match="score_window"):
        program.score_windows(WindowKey(ROWS + 1, WIDTH), _inputs(ROWS + 1, WIDTH))


@pytest.mark.parametrize("name,value,match", [
    ("token_ids", np.zeros((ROWS, WIDTH - 1), np.int32), r"token_ids must be int32\[3, 40\]"),
    ("target_ids", np.zeros((ROWS, WIDTH), np.int64), r"target_ids must be int32\[3, 40\]"),
    ("target_mask", np.zeros((ROWS, WIDTH), np.int32), r"target_mask must be bool\[3, 40\]"),
    ("num_valid", np.zeros(ROWS + 1, np.int32), r"num_valid must be int32\[3\]"),
])
def test_inputs_that_do_not_match_their_key_are_refused_by_name(name, value, match):
    program = core("dense").program
    with pytest.raises(ValueError, match=match):
        program.score_windows(WindowKey(ROWS, WIDTH), _inputs(ROWS, WIDTH, **{name: value}))


def test_an_empty_call_scores_nothing_and_keeps_no_state():
    """A call keeps nothing: an all-filler call between two identical calls changes nothing."""
    program = core("dense").program
    ids = reference("dense")["token_ids"][:, :WIDTH].astype(np.int32)
    n = ids.shape[1]
    full = _inputs(ROWS, WIDTH)
    full.token_ids[:, : n - 1] = ids[:, :-1]
    full.target_ids[:, : n - 1] = ids[:, 1:]
    full.target_mask[:, : n - 1] = True
    full.num_valid[:] = n - 1
    key = WindowKey(ROWS, WIDTH)
    first = jax.device_get(program.score_windows(key, full))
    empty = jax.device_get(program.score_windows(key, _inputs(ROWS, WIDTH)))
    assert not empty.logprobs.any() and empty.is_greedy.all()
    again = jax.device_get(program.score_windows(key, full))
    np.testing.assert_array_equal(first.logprobs, again.logprobs)


def test_a_scoring_program_needs_a_shape():
    from ninfer_jax.errors import ConfigError

    m = loaded("dense")
    with pytest.raises(ConfigError, match="at least one window shape"):
        ScoringProgram(m.config, m.params, [])


def test_concurrent_engine_calls_reach_the_program_one_at_a_time(monkeypatch):
    """The Engine's scoring purpose serializes callers before they reach the program."""
    from ninfer_jax.api import Engine
    from tests.conftest import FIXTURES

    with Engine.open(FIXTURES / "dense", purpose="causal_scoring", max_len=WIDTH,
                     max_batch_tokens=ROWS * WIDTH) as engine:
        program = engine.scorer.core.program
        real, inside, overlaps = program.score_windows, threading.Semaphore(1), []

        def spy(key, inputs):
            if not inside.acquire(blocking=False):
                overlaps.append(key)
                return real(key, inputs)
            try:
                return jax.block_until_ready(real(key, inputs))
            finally:
                inside.release()

        monkeypatch.setattr(program, "score_windows", spy)
        ids = reference("dense")["token_ids"].tolist()
        threads = [threading.Thread(target=engine.score, kwargs=dict(token_ids=[ids[i % 3]]))
                   for i in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert overlaps == []
