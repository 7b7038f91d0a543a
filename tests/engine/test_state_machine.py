"""A hypothesis state machine over the Engine with FakeProgram: random submits, cancels at random
moments and at exact worker points (FakeProgram hooks: Materializing, mid-prefill, a pending
batch, committed but not yet published), deadlines, stop strings and dropped handles, with and
without speculative rounds (several tokens a round, so stops and EOS land inside rounds; plain
rounds run with overlap, the default: each dispatched before the last one's output is
processed, so cancels, stops and deadlines land inside rounds ahead too). Every
accepted request ends exactly once, nothing follows its ending, its output is exactly the
single-request output up to its stop, and once the worker has nothing left to do every lane,
page and slot is free and capacity is full (checked as soon as the worker is idle, so a leak
fails at once rather than after a timeout)."""

from __future__ import annotations

import dataclasses
import queue
import time
import weakref
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ninfer_jax.engine import EngineCore, EngineCoreConfig, Finished, FinishReason, RejectedError
from ninfer_jax.sampling_params import SamplingParams
from ninfer_jax.testing.fake_program import HOOK_POINTS, FakeProgram, expected_tokens
from tests.engine.conftest import EOS, FRONTEND, TOKENIZER, limits, settle
from tests.engine.invariants import assert_transactions_settled

WORDS = st.text(alphabet="abcdefgh xyz", min_size=1, max_size=30)


@dataclasses.dataclass(eq=False)
class Live:
    """A request the machine still holds (dropping it drops the handle's last reference)."""

    handle: Any
    ids: list[int]
    sampling: SamplingParams
    deadline: float | None
    cancelled: bool = False


class EngineMachine(RuleBasedStateMachine):
    max_concurrency = 3
    verify_width = 1  # > 1: speculative rounds of up to this many tokens
    rewrites_below_frontier = 0  # MTP: 1 (its head's K/V at frontier - 1); DFlash: 0
    round_drafts = None  # the draft counts the Engine's policy picks each round among

    def __init__(self):
        super().__init__()
        lim = limits(self.max_concurrency, verify_width=self.verify_width,
                     rewrites_below_frontier=self.rewrites_below_frontier,
                     round_drafts=self.round_drafts)
        self.program = FakeProgram(lim, eos_id=EOS, step_seconds=0.0002)
        self.core = EngineCore(self.program, FRONTEND, EngineCoreConfig(max_queue=12,
                                                                        idle_wait_s=0.005))
        self.live: list[Live] = []
        self.ended = []  # handles read to their Finished: nothing may follow it
        self.dropped = 0
        self.accepted = 0

    @rule(text=WORDS, budget=st.integers(1, 24), seeded=st.booleans(), seed=st.integers(0, 99),
          deadline=st.sampled_from([None, None, None, 0.002, 0.05]),
          stop=st.sampled_from([(), (), ("e",), ("a b", "q"), (" ",)]),
          speculative=st.sampled_from(["on", "on", "off"]))
    def submit(self, text, budget, seeded, seed, deadline, stop, speculative):
        sp = SamplingParams(temperature=0.7 if seeded else 0.0, seed=seed, max_new_tokens=budget,
                            stop=stop, speculative=speculative)
        p = FRONTEND.prepare(prompt=text)
        try:
            h = self.core.submit(p, sp, deadline_s=deadline)
        except RejectedError as e:
            assert e.reason == "overload" and "max_queue is 12" in str(e)
            return
        self.accepted += 1
        self.live.append(Live(h, list(p.token_ids), sp, deadline))

    @rule(text=WORDS, budget=st.integers(1, 24), thinking=st.integers(1, 8),
          seeded=st.booleans(), seed=st.integers(0, 99))
    def submit_thinking(self, text, budget, thinking, seeded, seed):
        """A prompt that opens a thinking block and a thinking budget: forced control."""
        sp = SamplingParams(temperature=0.7 if seeded else 0.0, seed=seed, max_new_tokens=budget,
                            max_thinking_tokens=thinking)
        p = FRONTEND.prepare(prompt=f"{text}<think>")
        try:
            h = self.core.submit(p, sp)
        except RejectedError as e:
            assert e.reason == "overload" and "max_queue is 12" in str(e)
            return
        self.accepted += 1
        self.live.append(Live(h, list(p.token_ids), sp, None))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6), pause=st.sampled_from([0, 0, 0.001, 0.003]))
    def cancel(self, i, pause):
        time.sleep(pause)
        entry = self.live[i % len(self.live)]
        entry.cancelled = True
        entry.handle.cancel()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6), point=st.sampled_from(HOOK_POINTS))
    def cancel_at(self, i, point):
        """Cancels the request when the worker reaches `point` with its sequence (once; never,
        if it ends first). A twin request (same prompt and sampling) may trigger it earlier:
        still a valid moment to cancel."""
        ref = weakref.ref(self.live[i % len(self.live)])  # a hook must not keep it alive

        def hook(seqs):
            entry = ref()
            if entry is not None and not entry.cancelled and any(
                    s.tokens[: s.prompt_len] == entry.ids and s.sampling == entry.sampling
                    for s in seqs):
                entry.cancelled = True  # before the cancel: the consumer reads it after Finished
                entry.handle.cancel()

        self.program.on(point, hook)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6))
    def drop(self, i):
        self.live.pop(i % len(self.live))  # the last reference: its finalizer runs now
        self.dropped += 1

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6))
    def finish_one(self, i):
        self._check(self.live.pop(i % len(self.live)))

    @rule(pause=st.sampled_from([0.0005, 0.002]))
    def let_it_run(self, pause):
        time.sleep(pause)

    @invariant()
    def capacity_never_exceeded(self):
        s = self.core.stats()
        assert s.outstanding <= s.capacity and s.free_lanes <= s.total_lanes

    def _check(self, entry: Live):
        handle, sp = entry.handle, entry.sampling
        events = []
        while not handle.done:  # bounded: a request the worker never finishes fails here
            events.append(handle.next_event(timeout=10))
        finished = [e for e in events if isinstance(e, Finished)]
        assert len(finished) == 1 and events[-1] is finished[0]
        with_text = "".join(getattr(e, "text", "") for e in events)
        got = [t for e in events for t in getattr(e, "token_ids", ())]
        want = _expected(entry.ids, sp)
        reason = finished[0].finish_reason
        assert got == want[: len(got)]  # a prefix of the single-request output, always
        # With a stop string: the output ends at the token completing its first occurrence
        # (one byte a token here), and the text stops before it.
        text = bytes(t for t in want if t < 256).decode()  # EOS and markers are ids >= 256
        hits = [(text.index(s), s) for s in sp.stop if s in text]
        if hits:
            at, stop = min(hits)
            if at + len(stop) <= len(want) and EOS not in want[: at + len(stop)]:
                want = want[: at + len(stop)]
                if reason is FinishReason.STOP:
                    assert finished[0].stop_string == stop and with_text == text[:at]
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            assert got == want
        else:
            assert reason in (FinishReason.CANCELLED, FinishReason.DEADLINE)
            assert entry.cancelled or entry.deadline is not None
        assert finished[0].usage.completion_tokens == len(got)
        assert "\ufffd" not in with_text
        self.ended.append(handle)

    def teardown(self):
        try:
            for entry in self.live:
                self._check(entry)
            self.live.clear()
            s = settle(self.core)  # every consumer is done: returns once the worker is idle
            p = self.program.stats()
            for handle in self.ended:  # the worker is idle: anything after Finished is there now
                try:
                    extra = handle._sink.get(timeout=0)
                except queue.Empty:
                    extra = None
                assert extra is None, f"event after Finished: {extra}"
            assert s.available and s.outstanding == 0 and s.active == 0 and s.waiting == 0, s
            assert s.free_lanes == s.total_lanes
            assert p.free_pages == p.total_pages and p.reserved_pages == 0
            assert p.free_slots == p.total_slots and p.num_sequences == 0
            assert_transactions_settled(s, p.num_checkpoints)
        finally:
            self.core.close()


THINK_END = (*TOKENIZER.encode("\n"), TOKENIZER.think_ids[1], *TOKENIZER.encode("\n\n"))


def _expected(ids: list[int], sp: SamplingParams) -> list[int]:
    """What a request generates alone. With a thinking budget (its prompt opens the block and
    the fake model never closes it): the first max_thinking_tokens tokens, the forced end of
    the block, then the continuation of all that; a budget too small for the forced end stops
    at the thinking budget."""
    def fake(prompt: list[int], n: int) -> list[int]:
        return expected_tokens(prompt, n, seed=sp.seed or 0, vocab_size=TOKENIZER.vocab_size,
                               eos_id=EOS)

    budget = sp.max_thinking_tokens
    out = fake(ids, sp.max_new_tokens if budget is None else min(budget, sp.max_new_tokens))
    if budget is None or EOS in out or len(out) < budget:
        return out
    if len(out) + len(THINK_END) + 1 > sp.max_new_tokens:
        return out
    out += THINK_END
    return out + fake(ids + out, sp.max_new_tokens - len(out))


SETTINGS = settings(max_examples=70, stateful_step_count=20, deadline=None,
                    suppress_health_check=list(HealthCheck))


class OneLane(EngineMachine):
    max_concurrency = 1


class ThreeLanes(EngineMachine):
    max_concurrency = 3


class EightLanes(EngineMachine):
    max_concurrency = 8


class ThreeLanesSpeculative(EngineMachine):
    """MTP's limits: rounds of up to K + 1 = 4 tokens, one K/V position rewritten below; the
    draft policy picks each round's K among 0..3 (rounds of 0 chain ahead)."""

    max_concurrency = 3
    verify_width = 4
    rewrites_below_frontier = 1
    round_drafts = (0, 1, 2, 3)


class ThreeLanesDFlash(EngineMachine):
    """DFlash's limits at K = 15: rounds of up to 16 tokens (a budget, a stop or an EOS ends
    most requests inside one), nothing rewritten below the frontier."""

    max_concurrency = 3
    verify_width = 16
    round_drafts = (0, 1, 4, 8, 15)


TestOneLane = OneLane.TestCase
TestOneLane.settings = SETTINGS
TestThreeLanes = ThreeLanes.TestCase
TestThreeLanes.settings = SETTINGS
TestEightLanes = EightLanes.TestCase
TestEightLanes.settings = SETTINGS
TestThreeLanesSpeculative = ThreeLanesSpeculative.TestCase
TestThreeLanesSpeculative.settings = SETTINGS
TestThreeLanesDFlash = ThreeLanesDFlash.TestCase
TestThreeLanesDFlash.settings = SETTINGS
