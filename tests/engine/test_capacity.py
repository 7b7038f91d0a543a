"""Outstanding capacity (DESIGN §3): taken at submit, released exactly once when the worker is
done (`response_done`) AND the consumer has finished with the handle (`consumer_released`), in
either order; one half alone never frees it."""

from __future__ import annotations

import time

import pytest

from ninfer_jax.engine import FinishReason, RejectedError
from ninfer_jax.engine.handle import CapacityToken
from ninfer_jax.sampling_params import SamplingParams
from tests.engine.conftest import GREEDY, fake_engine, long_prompt, prompt, settle


@pytest.mark.parametrize("first, second", [("response_done", "consumer_released"),
                                           ("consumer_released", "response_done")])
def test_token_is_released_once_both_halves_hold(first, second):
    releases = []
    token = CapacityToken(lambda: releases.append(1))
    getattr(token, first)()
    getattr(token, first)()  # the same half twice is still one half
    assert releases == [] and not token.released
    getattr(token, second)()
    assert releases == [1] and token.released
    token.response_done()
    token.consumer_released()
    assert releases == [1]


def _wait_finished(core, n: int) -> None:
    """Until the worker has finished n requests (bounded; it publishes stats every iteration)."""
    deadline = time.monotonic() + 10
    while core.stats().finished_requests < n:
        assert time.monotonic() < deadline, core.stats()
        time.sleep(0.002)


def test_a_finished_request_holds_capacity_until_its_consumer_reads_it():
    with fake_engine(1, max_queue=1) as (core, _):
        h = core.submit(prompt("abc"), GREEDY)
        _wait_finished(core, 1)  # response_done; nobody has read the result yet
        with pytest.raises(RejectedError, match="queue full: 1 outstanding"):
            core.submit(prompt("next"), GREEDY)
        assert core.outstanding == 1
        assert h.result(timeout=10).finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        h.release()
        assert core.outstanding == 0  # as of now, not the worker's last snapshot
        assert core.submit(prompt("next"), GREEDY).result(timeout=10).error is None


def test_a_released_handle_holds_capacity_until_the_worker_is_done():
    with fake_engine(1, max_queue=1) as (core, program):
        gate = program.pause("after_decode")
        h = core.submit(prompt(long_prompt(20)), SamplingParams(temperature=0, max_new_tokens=20))
        gate.wait()
        h.release()  # consumer_released (and cancel); the worker is held mid-decode
        with pytest.raises(RejectedError, match="queue full: 1 outstanding"):
            core.submit(prompt("next"), GREEDY)
        gate.release()
        s = settle(core)
        assert s.outstanding == 0 and s.finished_requests == 1
        assert core.submit(prompt("next"), GREEDY).result(timeout=10).error is None
