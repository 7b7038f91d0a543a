"""Commit before publication (DESIGN §6): a consumer never sees a token whose Program commit has
not happened, or failed. Checked at every commit, with the worker held just before it: what each
consumer has received equals what the Program has committed for it, exactly."""

from __future__ import annotations

import queue

from ninfer_jax.engine import Delta, FinishReason
from ninfer_jax.sampling_params import SamplingParams
from tests.engine.conftest import fake_engine, long_prompt, prompt, want


def _received(handle, got: list[int]) -> None:
    """Adds every token already published to `handle` (without waiting: the worker is held)."""
    while not handle.done:
        try:
            event = handle.next_event(timeout=0)
        except queue.Empty:
            return
        if isinstance(event, Delta):
            got.extend(event.token_ids)


def test_consumers_see_exactly_the_committed_tokens_at_every_commit():
    texts = [long_prompt(10, tag) for tag in ("one", "two", "three")]
    sp = SamplingParams(temperature=0.0, max_new_tokens=10)
    with fake_engine(3) as (core, program):
        gate = program.pause("before_commit")
        handles = {tuple(prompt(t).token_ids): core.submit(prompt(t), sp) for t in texts}
        got = {ids: [] for ids in handles}
        remaining = 3 * 10  # tokens still to commit; every commit passes a gate
        while remaining:
            seqs = gate.wait()
            committed = {tuple(s.tokens[: s.prompt_len]): s.tokens[s.prompt_len:] for s in seqs}
            for ids, h in handles.items():
                _received(h, got[ids])
                if ids in committed:  # its batch is about to commit: only its committed past
                    assert got[ids] == committed[ids], f"published ahead of commit: {got[ids]}"
            remaining -= len(seqs)
            held, gate = gate, program.pause("before_commit") if remaining else None
            held.release()  # the next gate is armed before the held worker moves on
        for t in texts:  # the result folds in the events read above
            assert list(handles[tuple(prompt(t).token_ids)].result(timeout=10).token_ids) == want(
                t, 10)


def test_a_failed_commit_publishes_none_of_its_batch():
    text = long_prompt(10)
    with fake_engine(1, program_kw={"fail_commit_at": 4}) as (core, _):
        r = core.submit(prompt(text), SamplingParams(temperature=0, max_new_tokens=10)).result(
            timeout=10)
    assert r.finish_reason is FinishReason.ERROR and "InjectedFailure" in r.error
    # Commits 0-3 (the prefill's token, three decode rounds) succeeded; the 5th token was not.
    assert list(r.token_ids) == want(text, 10)[:4]


def test_stats_count_a_request_once_its_consumer_has_read_its_end():
    """The worker publishes a request's Finished in the middle of an iteration (the next
    admission may follow in the same iteration): the stats a consumer reads after it already
    count that request, and its tokens and lane. Held at the next request's materialization."""
    text = long_prompt(4)
    with fake_engine(1) as (core, program):
        gate = program.pause("after_materialize", lambda seqs: program.num_commits > 0)
        first = core.submit(prompt(text), SamplingParams(temperature=0, max_new_tokens=4))
        second = core.submit(prompt("next"), SamplingParams(temperature=0, max_new_tokens=2))
        gate.wait()
        assert list(first.result(timeout=10).token_ids) == want(text, 4)
        s = core.stats()
        assert (s.finished_requests, s.generated_tokens) == (1, 4), s
        gate.release()
        second.result(timeout=10)
