"""CausalScoring as a start-time purpose of the public Engine: `Engine.open(purpose=
"causal_scoring")` scores like `Scorer` (checked against transformers' log-probs), calls from
several threads run one at a time, and each purpose refuses the other's calls by name."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from ninfer_jax.api import Engine
from ninfer_jax.errors import ConfigError
from tests.conftest import FIXTURES
from tests.models.conftest import reference, rel_err
from tests.scoring.conftest import ROWS, WIDTH, transformers_logprobs

TOL = 1e-5


@pytest.fixture(scope="module")
def engine():
    with Engine.open(FIXTURES / "dense", purpose="causal_scoring", max_len=WIDTH,
                     max_batch_tokens=ROWS * WIDTH) as e:
        yield e


def test_scores_match_transformers(engine):
    assert engine.purpose == "causal_scoring" and engine.available
    ids = reference("dense")["token_ids"]
    want, want_greedy = transformers_logprobs("dense")
    results = engine.score(token_ids=ids.tolist())
    assert rel_err(np.stack([r.token_logprobs for r in results]), want) <= TOL
    np.testing.assert_array_equal(np.stack([r.greedy_flags for r in results]), want_greedy)
    # concurrent callers: serialized, each gets its own items' results
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        rows = list(pool.map(lambda i: engine.score(token_ids=[ids[i].tolist()])[0], range(3)))
    for row, w in zip(rows, want):
        assert rel_err(row.token_logprobs, w) <= TOL


def test_each_purpose_refuses_the_others_calls(engine):
    with pytest.raises(ConfigError, match=r"submit\(\) needs an Engine opened with purpose="
                                          r"'generation'"):
        engine.generate("hello")
    with pytest.raises(ConfigError, match="stats"):
        engine.stats()
    from tests.gateway.conftest import make_engine

    gen = make_engine()
    try:
        with pytest.raises(ConfigError, match=r"score\(\) needs an Engine opened with "
                                              r"purpose='causal_scoring'"):
            gen.score(texts=["x"])
    finally:
        gen.close()


def test_bad_settings_name_the_setting():
    with pytest.raises(ConfigError, match="purpose must be one of"):
        Engine.open(FIXTURES / "dense", purpose="chat")
    with pytest.raises(ConfigError, match="max_concurrency is a generation setting"):
        Engine.open(FIXTURES / "dense", purpose="causal_scoring", max_concurrency=2)
    with pytest.raises(ConfigError, match="window"):
        Engine.open(FIXTURES / "dense", purpose="causal_scoring", window=0)


def test_a_closed_scoring_engine_refuses_calls():
    e = Engine.open(FIXTURES / "dense", purpose="causal_scoring", max_len=WIDTH,
                    max_batch_tokens=ROWS * WIDTH)
    e.close()
    assert not e.available
    with pytest.raises(ConfigError, match="closed"):
        e.score(token_ids=[[1, 2, 3]])
