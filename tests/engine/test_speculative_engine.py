"""MTP speculative decoding through the Engine.

On the embedded demo model (a trained MTP head, K = 2, max_concurrency 4): greedy output, text,
finish reason and completion_tokens equal decoding without speculation, with prefix reuse on and
off, in any arrival order, in multi-turn chats that restore checkpoints, and when a stop string,
an EOS or the budget ends a request inside a round (the Engine commits exactly the accepted
prefix); seeded sampled requests give the same tokens alone or in any company; the Engine's
speculative statistics add up. On the FakeProgram (rounds of up to 4 tokens): a cancel while a
multi-token round is pending commits nothing, and an EOS inside a round ends the output there
and leaves the state after it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest

from ninfer_jax.api import Engine
from ninfer_jax.engine import Delta, EngineCore, EngineCoreConfig, FinishReason
from ninfer_jax.program.pending import BatchKind
from ninfer_jax.sampling_params import SamplingParams
from ninfer_jax.testing.fake_program import expected_tokens
from tests.engine.conftest import (
    EOS,
    FRONTEND,
    TOKENIZER,
    fake_engine,
    long_prompt,
    prompt,
    settle,
    want,
)
from tests.program.test_speculative_program import PCFG

K = 2
# The Program tests' settings: the same executables, so the persistent compilation cache
# serves whichever module compiles second.
SETTINGS = {k: v for k, v in PCFG.items() if k != "max_concurrency"}
MAX_CONCURRENCY = 4


@functools.cache
def _opened(k: int, method: str = "mtp", settings: tuple = tuple(SETTINGS.items())):
    """(Program, Frontend, model path) of `Engine.open` on the demo model, K = k (0: off) with
    `method`'s drafts, every round of K unless `settings` names another draft_policy, compiled. The Engines below run on it one at a time, each with its own
    EngineCore (prefix reuse is the EngineCore's setting)."""
    spec = {"speculative": method, "num_speculative_tokens": k,
            "draft_policy": "fixed"} if k else {}
    opened = Engine.open(**{"max_concurrency": MAX_CONCURRENCY, **spec, **dict(settings)})
    opened.core.program.wait_compiled()
    opened.close()  # stops its worker; the Program stays usable
    return opened.core.program, opened.frontend, opened.model_path


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a batch the Engine committed."""

    kind: BatchKind
    tokens: tuple[int, ...]  # the sequence's tokens before the batch (prefill: the prompt)
    produced: int
    accepted: int


@contextlib.contextmanager
def engine(k: int, prefix_reuse: bool = True, opened=None):
    """An Engine over the shared Program (`_opened(k)`'s, or `opened`); yields (engine, rows):
    every Row the Engine committed, in order. On exit the Program holds nothing."""
    program, frontend, path = opened or _opened(k)
    decisions: list[Row] = []

    def recording_commit(batch, accepted):
        decisions.extend(Row(batch.kind, tuple(program.tokens(h)), int(p), int(a))
                         for h, p, a in zip(batch.handles, batch.produced, accepted))
        return type(program).commit(program, batch, accepted)

    program.commit = recording_commit
    try:
        with Engine(EngineCore(program, frontend, EngineCoreConfig(prefix_reuse=prefix_reuse)),
                    frontend, path) as e:
            yield e, decisions
    finally:
        del program.commit
    s = program.stats()
    assert s.num_sequences == 0 and s.num_checkpoints == 0, s
    assert s.free_pages == s.total_pages and s.free_slots == s.total_slots, s


def _decode_rows(decisions: list[Row]) -> list[tuple[int, int]]:
    """(produced, accepted) of every decode row that committed tokens."""
    return [(r.produced, r.accepted) for r in decisions
            if r.kind is BatchKind.DECODE and r.accepted > 0]


def _ids(text: str) -> list[int]:
    return list(_opened(K)[1].prepare(prompt=text).token_ids)


def _requests() -> list[tuple[dict, SamplingParams]]:
    """Greedy requests whose ends fall inside rounds with K = 2 (seen in the decisions): a stop
    string completed by the 2nd token of a 3-token round ("girl", "wanted", "big"), an EOS
    that is the 1st of 3, budgets that cut a round short. The last prompt extends the first
    one's stopped turn, so with reuse on it restores that turn's checkpoint (one at a time) or
    the first prompt's."""
    greedy = functools.partial(SamplingParams, temperature=0.0)
    return [
        ({"prompt": "Once upon a time"}, greedy(max_new_tokens=24, stop=("girl",))),
        ({"prompt": "Tom had a dog"}, greedy(max_new_tokens=20, stop=("wanted",))),
        ({"prompt": "The sun was"}, greedy(max_new_tokens=6)),
        ({"prompt": "Lily and Ben went to the park"}, greedy(max_new_tokens=30, stop=("big",))),
        ({"prompt": "They lived happily ever after"}, greedy(max_new_tokens=10)),
        ({"prompt": "One day, a little bird"}, greedy(max_new_tokens=25)),
        ({"prompt_token_ids": _ids("Once upon a time") + _ids(", there was a little")
          + _ids(" dog")}, greedy(max_new_tokens=16)),
    ]


def _outcome(r):
    return (r.text, r.token_ids, r.finish_reason, r.stop_string, r.usage.completion_tokens)


def _run(e: Engine, requests, order, arrival: str = "together") -> dict:
    """Submits requests[i] for i in `order`: all at once, each after the previous one's first
    token (staggered), or each after the previous one ended; returns {i: result}."""
    handles = {}
    for i in order:
        inputs, sampling = requests[i]
        handles[i] = h = e.submit(**inputs, sampling=sampling)
        if arrival == "staggered":
            while not h.done and not isinstance(h.next_event(timeout=120), Delta):
                pass
        elif arrival == "one_at_a_time":
            h.result(timeout=120)
    return {i: h.result(timeout=120) for i, h in handles.items()}


@functools.cache
def _reference() -> dict:
    """Every request's outcome without speculation (reuse off, all at once)."""
    with engine(0, prefix_reuse=False) as (e, _):
        return {i: _outcome(r) for i, r in _run(e, _requests(),
                                                range(len(_requests()))).items()}


@pytest.mark.slow  # ~75 s cold with reuse: the default run's 15 minutes
@pytest.mark.parametrize("reuse", [True, False])
def test_greedy_equals_no_speculation_in_any_arrival_order(reuse):
    requests, want_out = _requests(), _reference()
    n = len(requests)
    assert {o[2] for o in want_out.values()} == {FinishReason.STOP, FinishReason.LENGTH}
    assert want_out[4][1][-1] in _opened(0)[1].tokenizer.eos_ids  # first of a 3-token round
    with engine(K, prefix_reuse=reuse) as (e, decisions):
        for order, arrival in ((range(n), "together"), (reversed(range(n)), "together"),
                               ((3, 0, 6, 1, 5, 2, 4), "staggered"),
                               ((0, 6, 1, 2, 3, 4, 5), "one_at_a_time")):
            got = _run(e, requests, list(order), arrival)
            assert {i: _outcome(r) for i, r in got.items()} == want_out, (reuse, arrival)
            if reuse and arrival == "one_at_a_time":  # request 0's stopped turn restored
                extended = requests[6][0]["prompt_token_ids"]
                assert got[6].usage.cached_tokens == len(extended) - 1
        rows = _decode_rows(decisions)
        # Ends inside rounds happened: rows that committed a strict prefix of their round.
        assert sum(0 < a < p for p, a in rows) >= 4 * 3
        assert max(p for p, _ in rows) == K + 1
        assert (e.stats().prefix.hits > 0) == reuse


@pytest.mark.slow  # ~44 s cold: the default run's 15 minutes
def test_multi_turn_chat_restores_checkpoints_with_speculation_and_equals_recompute():
    """Each follow-up restores a checkpoint (GDN state, K/V, the head's context): its output
    equals decoding without speculation, and its rounds (how many drafts held) equal those of
    a recompute with speculation."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    turns = []  # the messages of each turn
    with engine(K) as (e, rows):
        messages, results, rounds = [], [], []
        for text in ("Tell me a story.", "More.", "Go on."):
            messages.append({"role": "user", "content": text})
            turns.append(list(messages))
            results.append(e.submit(messages=messages, sampling=sampling,
                                    session="chat").result(120))
            rounds.append(_decode_rows(rows))
            rows.clear()
            messages.append({"role": "assistant", "content": results[-1].text})
    cached = [r.usage.cached_tokens for r in results]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
    for k, reuse in ((0, False), (K, False)):
        with engine(k, prefix_reuse=reuse) as (e, rows):
            for messages, restored, restored_rounds in zip(turns, results, rounds):
                again = e.submit(messages=messages, sampling=sampling).result(120)
                assert _outcome(again) == _outcome(restored)
                if k:
                    assert _decode_rows(rows) == restored_rounds
                rows.clear()


def _rounds(rows: list[Row], prefix: list[int], other: list[int]) -> list[int]:
    """Tokens produced by each decode round of the sequence starting with `prefix` and not
    with `other`."""
    return [r.produced for r in rows if r.kind is BatchKind.DECODE
            and r.tokens[: len(prefix)] == tuple(prefix)
            and r.tokens[: len(other)] != tuple(other)]


def test_a_restore_while_its_source_decodes_changes_neither_ones_drafts():
    """B restores the checkpoint at the end of A's prompt while A decodes. The head's K/V at a
    frontier's last position is rewritten by the round after it, so each continuation writes
    its own copy of that page (here a full page: the frontier is on a page boundary), never
    the shared one: each request's rounds, how many drafts held, are those it has alone."""
    a = _ids("One day, a little bird named")
    b = a + _ids(" Sam")
    assert len(a) % SETTINGS["page_size"] == 0
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    with engine(K, prefix_reuse=False) as (e, rows):
        alone = {name: e.submit(prompt_token_ids=ids, sampling=greedy).result(120)
                 for name, ids in (("a", a), ("b", b))}
        want_rounds = (_rounds(rows, a, b), _rounds(rows, b, a + [-1]))
    assert alone["a"].token_ids[0] != b[len(a)]  # the rows of A and B tell apart
    with engine(K) as (e, rows):
        first = e.submit(prompt_token_ids=a, sampling=greedy)
        while not isinstance(first.next_event(timeout=120), Delta):
            pass
        second = e.submit(prompt_token_ids=b, sampling=greedy).result(120)
        assert second.usage.cached_tokens == len(a)
        assert (first.result(120).token_ids, second.token_ids) == (
            alone["a"].token_ids, alone["b"].token_ids)
        assert (_rounds(rows, a, b), _rounds(rows, b, a + [-1])) == want_rounds


def test_seeded_sampling_is_reproducible_alone_or_in_any_company():
    sampled = [SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_new_tokens=16)
               for seed in (7, 8, 9)]
    prompts = ["Once upon a time", "The dog ran to the", "Tom and Sue"]
    requests = [({"prompt": p}, sp) for p, sp in zip(prompts, sampled)]
    fillers = [({"prompt": "The sun was"}, SamplingParams(temperature=0.0, max_new_tokens=12)),
               ({"prompt": "One day"}, SamplingParams(temperature=0.5, seed=1,
                                                     max_new_tokens=20))]
    with engine(K, prefix_reuse=False) as (e, decisions):  # alone, and from root
        alone = {i: _run(e, requests, [i])[i].token_ids for i in range(3)}
        assert max(p for p, _ in _decode_rows(decisions)) > 1  # sampled drafts were accepted
    everyone = requests + fillers
    with engine(K) as (e, _):
        for order, arrival in (((4, 0, 3, 1, 2), "together"), ((2, 3, 1, 4, 0), "staggered")):
            got = _run(e, everyone, order, arrival)
            assert {i: got[i].token_ids for i in range(3)} == alone, arrival
    assert len({alone[i] for i in range(3)}) == 3


def test_the_adaptive_policy_keeps_greedy_output_and_per_request_off_drafts_nothing():
    """draft_policy="adaptive" (the default): each round's K is chosen among 0..K from what
    the Engine measured (its first rounds at a B try every K), rows of requests with
    speculative="off" propose one token a round, and every output is the greedy one of
    speculation off whatever K its rounds had."""
    opened = _opened(K, "mtp", tuple({**SETTINGS, "draft_policy": "adaptive",
                                      "max_concurrency": 2}.items()))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    off = dataclasses.replace(greedy, speculative="off")
    texts = ["Once upon a time", "The dog ran to the", "Tom and Sue", "One day, a little"]
    with engine(0) as (e, _):
        want = [e.submit(prompt=t, sampling=greedy).result(120).token_ids for t in texts]
    with engine(K, opened=opened) as (e, rows):
        alone = e.submit(prompt=texts[0], sampling=greedy).result(120)  # B = 1: explores
        spec = e.stats().speculative
        assert spec.policy == "adaptive"
        assert {k for k, n in spec.rounds_by_drafts} == {0, 1, 2}
        assert {(k, b) for k, b, _ in spec.round_ms} == {(0, 1), (1, 1), (2, 1)}
        rows.clear()
        handles = [e.submit(prompt=t, sampling=off if i % 2 else greedy)
                   for i, t in enumerate(texts)]
        got = [h.result(120).token_ids for h in handles]
    assert [alone.token_ids, *got[1:]] == want and got[0] == want[0]
    for i, t in enumerate(texts):
        ids = list(opened[1].prepare(prompt=t).token_ids)
        others = [list(opened[1].prepare(prompt=o).token_ids) for o in texts if o != t]
        produced = [r.produced for r in rows if r.kind is BatchKind.DECODE
                    and list(r.tokens[:len(ids)]) == ids
                    and not any(list(r.tokens[:len(o)]) == o for o in others if len(o) > len(ids))]
        assert produced and (max(produced) == 1 if i % 2 else True), (t, produced)


def test_speculative_stats_add_up():
    requests = _requests()[:4]
    with engine(K) as (e, decisions):
        _run(e, requests, range(len(requests)))
        spec = e.stats().speculative
        rows = _decode_rows(decisions)
    assert spec.num_speculative_tokens == K
    assert spec.verify_rows == len(rows) > 0
    assert spec.committed_tokens == sum(a for _, a in rows)
    assert 1 <= spec.mean_accepted_tokens <= K + 1
    assert spec.mean_accepted_tokens == spec.committed_tokens / spec.verify_rows
    assert len(spec.acceptance_by_position) == K
    assert all(0 <= rate <= 1 for rate in spec.acceptance_by_position)
    assert spec.acceptance_by_position[0] > 0  # the trained head's first drafts often hold
    with engine(0) as (e, _):
        _run(e, requests, range(len(requests)))
        off = e.stats().speculative
    assert (off.num_speculative_tokens, off.verify_rows, off.committed_tokens) == (0, 0, 0)
    assert off.mean_accepted_tokens == 0.0 and off.acceptance_by_position == ()


# FakeProgram: exact moments, rounds of up to 4 tokens (a hash of the state picks how many).
def _fake(max_concurrency: int, **kw):
    return fake_engine(max_concurrency, verify_width=4, rewrites_below_frontier=1, **kw)


def test_cancel_while_a_multi_token_round_is_pending_commits_none_of_it():
    texts = [long_prompt(16, tag) for tag in ("first", "second", "third")]
    by_prompt = {tuple(prompt(t).token_ids): t for t in texts}
    greedy = SamplingParams(temperature=0.0, max_new_tokens=16)
    with _fake(3) as (core, program):
        gate = program.pause("after_decode", lambda seqs: len(seqs) == 3
                             and program.pending.produced[1] > 1)
        after = {}  # prompt -> tokens generated once the held round is committed

        def record(seqs):
            if gate.reached and not after:
                after.update({by_prompt[tuple(s.tokens[: s.prompt_len])]: s.generated
                              for s in seqs})

        program.on("after_commit", record)
        handles = {t: core.submit(prompt(t), greedy) for t in texts}
        seqs = gate.wait()
        victim = by_prompt[tuple(seqs[1].tokens[: seqs[1].prompt_len])]
        before = {by_prompt[tuple(s.tokens[: s.prompt_len])]: s.generated for s in seqs}
        handles[victim].cancel()
        gate.release()
        for text, h in handles.items():
            r = h.result(timeout=10)
            if text == victim:  # its round's tokens were never committed nor published
                assert after[text] == before[text]
                assert r.finish_reason is FinishReason.CANCELLED
                assert list(r.token_ids) == want(text, 16)[: before[text]]
                assert r.usage.completion_tokens == before[text]
            else:
                assert after[text] > before[text]
                assert r.finish_reason is FinishReason.LENGTH
                assert list(r.token_ids) == want(text, 16)
        settle(core)
        s = program.stats()
        assert s.num_sequences == 0 and s.free_slots == s.total_slots
        assert s.free_pages == s.total_pages and s.reserved_pages == 0


def test_an_eos_inside_a_round_ends_the_output_and_the_state_there():
    """The FakeProgram's round goes on past an EOS (as the real verify step does): the Engine
    commits up to the EOS, and the turn's checkpoint holds the state there, so a follow-up
    that restores it continues as a recompute does."""
    text = "tale 0"  # its output ends with an EOS that a round of 4 proposes first
    greedy = SamplingParams(temperature=0.0, max_new_tokens=40)
    with _fake(1, total_checkpoint_slots=2) as (core, program):
        rounds = []
        program.on("before_commit", lambda seqs: rounds.append(
            program.pending.row_tokens(0)) if program.pending.kind is BatchKind.DECODE else None)
        r = core.submit(prompt(text), greedy).result(timeout=10)
        out = want(text, 40)
        assert out[-1] == EOS and list(r.token_ids) == out
        assert r.finish_reason is FinishReason.STOP and r.usage.completion_tokens == len(out)
        assert EOS in rounds[-1][:-1]  # the EOS came with tokens after it in its round
        follow = list(prompt(text).token_ids) + out[:-1] + list(b" and on")
        again = core.submit(FRONTEND.prepare(prompt_token_ids=follow), greedy).result(timeout=10)
        assert again.usage.cached_tokens == len(follow) - len(b" and on")
        assert list(again.token_ids) == expected_tokens(
            follow, 40, vocab_size=TOKENIZER.vocab_size, eos_id=EOS)
