"""`Engine.warm_up` (run by `ninfer serve` before its port opens) and per-request
`prefix_reuse=False`: neither reads nor leaves a prefix checkpoint."""

from __future__ import annotations

import pytest

from ninfer_jax.engine import RejectedError
from ninfer_jax.sampling_params import SamplingParams
from tests.gateway.conftest import make_engine, wait_idle


def test_warm_up_serves_one_request_and_leaves_no_checkpoint():
    engine = make_engine(checkpoints=8)
    try:
        assert engine.warm_up() >= 0
        stats = wait_idle(engine)
        assert stats.finished_requests == 1 and stats.generated_tokens >= 1
        assert stats.prefix.checkpoints == 0 and stats.prefix.hits == 0
    finally:
        engine.close()


def test_prefix_reuse_off_for_one_request():
    engine = make_engine(checkpoints=8)
    sampling = SamplingParams(max_new_tokens=4, temperature=0)
    try:
        text = "a prompt long enough to span a few pages of sixteen tokens each, twice over."
        texts = (text, text + " And more.")  # the second extends the first
        off = [engine.generate(t, sampling=sampling, prefix_reuse=False) for t in texts]
        assert [r.usage.cached_tokens for r in off] == [0, 0]
        assert wait_idle(engine).prefix.checkpoints == 0
        on = [engine.generate(t, sampling=sampling) for t in texts]
        assert on[0].usage.cached_tokens == 0 and on[1].usage.cached_tokens > 0
        assert on[0].token_ids == off[0].token_ids  # the same answer either way
        with pytest.raises(RejectedError, match="prefix_reuse"):
            engine.submit(text, prefix_reuse="no")
    finally:
        engine.close()
