"""Cancellation, deadlines and queue timeouts at exact worker points (DESIGN §8), never after a
sleep: a FakeProgram gate holds the worker where the case needs it (Materializing, between
prefill chunks, with a prefill or decode PendingBatch pending, committed but not yet published)
while the test cancels, so each outcome is exact: how many tokens, which events, what state."""

from __future__ import annotations

import time

from ninfer_jax.engine import Delta, Finished, FinishReason, GenerationStart
from ninfer_jax.sampling_params import SamplingParams
from tests.engine.conftest import GREEDY, fake_engine, long_prompt, prompt, want


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=n)


def _events(handle, timeout: float = 10.0) -> list:
    events = []
    while not handle.done:
        events.append(handle.next_event(timeout=timeout))
    return events


def _tokens(events) -> list[int]:
    return [t for e in events if isinstance(e, Delta) for t in e.token_ids]


def _ids(text: str) -> list[int]:
    return list(prompt(text).token_ids)


def test_cancel_while_waiting_ends_it_before_any_program_state():
    text = long_prompt(20)
    with fake_engine(1) as (core, program):
        materialized = []
        program.on("after_materialize", lambda seqs: materialized.append(seqs[0].tokens[:]))
        gate = program.pause("after_decode")
        running = core.submit(prompt(text), _greedy(20))
        gate.wait()  # the only lane is busy: whatever comes next waits
        queued = core.submit(prompt("queued"), GREEDY)
        queued.cancel()
        gate.release()
        events = _events(queued)
        assert len(events) == 1 and events[0].finish_reason is FinishReason.CANCELLED
        assert events[0].usage.completion_tokens == 0
        assert list(running.result(timeout=10).token_ids) == want(text, 20)
        assert materialized == [_ids(text)]


def test_cancel_while_materializing_aborts_the_transition():
    with fake_engine(1) as (core, program):
        gate = program.pause("after_materialize")
        h = core.submit(prompt("abc"), GREEDY)
        gate.wait()
        assert program.stats().num_sequences == 1
        h.cancel()
        gate.release()
        events = _events(h)
        # Never Active: no GenerationStart, no model step, the sequence released.
        assert [type(e) for e in events] == [Finished]
        assert events[0].finish_reason is FinishReason.CANCELLED
        assert program.num_steps == 0 and program.stats().num_sequences == 0
        stats = program.stats()
        assert stats.free_pages == stats.total_pages and stats.free_slots == stats.total_slots


def test_cancel_between_prefill_chunks_stops_the_prefill():
    text = "x" * 20  # chunks of 8: [0, 8), [8, 16), [16, 20)
    with fake_engine(1) as (core, program):
        gate = program.pause("after_prefill", lambda seqs: seqs[0].frontier == 8)
        h = core.submit(prompt(text), GREEDY)
        gate.wait()
        h.cancel()
        gate.release()
        events = _events(h)
        assert isinstance(events[0], GenerationStart) and events[0].prompt_tokens == 20
        assert events[-1].finish_reason is FinishReason.CANCELLED and _tokens(events) == []
        assert program.prefilled_tokens == 8 and program.num_steps == 1
        assert program.stats().num_sequences == 0


def test_cancel_while_the_prefill_batch_is_pending_accepts_nothing():
    with fake_engine(1, total_checkpoint_slots=2) as (core, program):
        decisions = []
        program.on("after_commit", lambda seqs: decisions.append(seqs[0].generated))
        gate = program.pause("after_prefill", lambda seqs: program.pending is not None)
        h = core.submit(prompt("abc"), GREEDY)
        gate.wait()
        h.cancel()
        gate.release()
        events = _events(h)
        assert events[-1].finish_reason is FinishReason.CANCELLED and _tokens(events) == []
        # The batch was committed with the cancelled row's decision (0 tokens); nothing retained.
        assert decisions == [0] and program.num_commits == 1
        assert program.stats().num_checkpoints == 0 and program.stats().num_sequences == 0


def test_cancel_one_row_of_a_pending_decode_batch():
    texts = [long_prompt(12, tag) for tag in ("first", "second", "third")]
    by_prompt = {tuple(_ids(t)): t for t in texts}
    with fake_engine(3) as (core, program):
        gate = program.pause("after_decode", lambda seqs: len(seqs) == 3)
        handles = {t: core.submit(prompt(t), _greedy(12)) for t in texts}
        seqs = gate.wait()
        victim = by_prompt[tuple(seqs[1].tokens[: seqs[1].prompt_len])]
        committed = seqs[1].generated  # the pending batch holds its next token
        handles[victim].cancel()
        gate.release()
        for text, h in handles.items():
            r = h.result(timeout=10)
            if text == victim:
                assert r.finish_reason is FinishReason.CANCELLED
                assert list(r.token_ids) == want(text, 12)[:committed]
            else:
                assert r.finish_reason is FinishReason.LENGTH
                assert list(r.token_ids) == want(text, 12)


def test_cancel_after_commit_delivers_the_committed_token_first():
    text = long_prompt(20)
    with fake_engine(1) as (core, program):
        gate = program.pause("after_commit", lambda seqs: seqs[0].generated == 3)
        h = core.submit(prompt(text), _greedy(20))
        gate.wait()
        h.cancel()
        gate.release()
        r = h.result(timeout=10)
        assert r.finish_reason is FinishReason.CANCELLED
        assert list(r.token_ids) == want(text, 20)[:3]


def test_deadline_and_queue_timeout_pass_while_the_worker_is_held():
    text = long_prompt(20)
    with fake_engine(1) as (core, program):
        gate = program.pause("after_prefill", lambda seqs: program.pending is not None)
        start = time.monotonic()
        running = core.submit(prompt(text), _greedy(20), deadline_s=1.0)
        waiting = core.submit(prompt("waits"), GREEDY, queue_timeout_s=0.05)
        gate.wait()
        time.sleep(max(0.0, start + 1.05 - time.monotonic()))  # both limits are now behind
        gate.release()
        w = waiting.result(timeout=10)
        assert w.finish_reason is FinishReason.ERROR and w.error.startswith("queue_timeout")
        assert w.usage.completion_tokens == 0
        r = running.result(timeout=10)
        # The pending first token was committed and published; the deadline ended it after that.
        assert r.finish_reason is FinishReason.DEADLINE
        assert list(r.token_ids) == want(text, 20)[:1]
        assert program.stats().num_sequences == 0
