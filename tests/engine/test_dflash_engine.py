"""DFlash speculative decoding through the Engine, on the embedded demo model with its shipped
drafter (K = 4, max_concurrency 4, the settings of `tests/program/test_dflash_program.py` and of
the MTP tests, so the modules share executables through the persistent cache).

Greedy output, text, finish reason and completion_tokens equal decoding without speculation, with
prefix reuse on and off, in any arrival order, and when a stop string, an EOS or the budget ends
a request inside a round; multi-turn chats restore checkpoints (the drafter's context window
with them) and draft exactly what a recompute drafts; seeded sampled requests give the same
tokens alone or in any company; the statistics add up, per draft position.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from ninfer_jax.sampling_params import SamplingParams
from tests.engine.test_speculative_engine import (
    SETTINGS,
    _decode_rows,
    _opened,
    _outcome,
    _reference,
    _requests,
    _run,
    engine,
)

K = 4


@functools.cache
def _dflash(k: int = K):
    return _opened(k, "dflash", tuple(SETTINGS.items()))


def _check_greedy_equal(k: int, opened, requests, want_out: dict, orders) -> None:
    """With reuse on and off and each (order, arrival) of `orders`, every request's outcome
    equals `want_out` (decoding without speculation)."""
    for reuse in (True, False):
        with engine(k, prefix_reuse=reuse, opened=opened) as (e, decisions):
            for order, arrival in orders:
                got = _run(e, requests, list(order), arrival)
                assert {i: _outcome(r) for i, r in got.items()} == want_out, (reuse, arrival)
            rows = _decode_rows(decisions)
            assert sum(0 < a < p for p, a in rows) >= 4  # ends inside rounds
            assert max(p for p, _ in rows) >= min(k + 1, 6)  # long blocks accepted
            assert (e.stats().prefix.hits > 0) == reuse


@pytest.mark.slow  # ~51 s cold: the default run's 15 minutes
def test_greedy_equals_no_speculation_with_reuse_on_and_off_in_any_arrival_order():
    n = len(_requests())
    _check_greedy_equal(K, _dflash(), _requests(), _reference(),
                        ((range(n), "together"), (range(n - 1, -1, -1), "together"),
                         ((3, 0, 6, 1, 5, 2, 4), "staggered"),
                         ((0, 6, 1, 2, 3, 4, 5), "one_at_a_time")))


@pytest.mark.slow
@pytest.mark.parametrize("k", [8, 15])
def test_greedy_equals_no_speculation_at_b_1_to_8(k):
    """K = 8 and 15 on an Engine of max_concurrency 8, eight requests (the seven above and a
    long one), reuse on and off, together in two orders, staggered and one at a time."""
    requests = [*_requests(), ({"prompt": "Once upon a time, in a big forest,"},
                               SamplingParams(temperature=0.0, max_new_tokens=40))]
    with engine(0, prefix_reuse=False) as (e, _):
        want_out = {i: _outcome(r) for i, r in _run(e, requests, range(8)).items()}
    opened = _opened(k, "dflash", tuple({**SETTINGS, "max_concurrency": 8}.items()))
    _check_greedy_equal(k, opened, requests, want_out,
                        ((range(8), "together"), (range(7, -1, -1), "together"),
                         ((3, 7, 0, 6, 1, 5, 2, 4), "staggered"),
                         ((0, 6, 1, 7, 2, 3, 4, 5), "one_at_a_time")))


@pytest.mark.slow  # ~80 s cold: the default run's 15 minutes
def test_multi_turn_chat_restores_the_drafters_context_and_equals_recompute():
    """Each follow-up restores a checkpoint (GDN state, K/V, the drafter's context window):
    its output equals decoding without speculation, and its rounds (how many drafts held)
    equal those of a recompute with DFlash."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=8)
    turns = []
    with engine(K, opened=_dflash()) as (e, rows):
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
    for opened, reuse in ((_opened(0), False), (_dflash(), False)):
        with engine(K, prefix_reuse=reuse, opened=opened) as (e, rows):
            for messages, restored, restored_rounds in zip(turns, results, rounds):
                again = e.submit(messages=messages, sampling=sampling).result(120)
                assert _outcome(again) == _outcome(restored)
                if opened is not _opened(0):
                    assert _decode_rows(rows) == restored_rounds
                rows.clear()


@pytest.mark.slow  # ~23 s; with MTP in the default run (test_speculative_engine.py)
def test_seeded_sampling_is_reproducible_alone_or_in_any_company():
    sampled = [SamplingParams(temperature=0.8, top_p=0.95, seed=seed, max_new_tokens=16)
               for seed in (7, 8, 9)]
    prompts = ["Once upon a time", "The dog ran to the", "Tom and Sue"]
    requests = [({"prompt": p}, sp) for p, sp in zip(prompts, sampled)]
    fillers = [({"prompt": "The sun was"}, SamplingParams(temperature=0.0, max_new_tokens=12)),
               ({"prompt": "One day"}, SamplingParams(temperature=0.5, seed=1,
                                                     max_new_tokens=20))]
    with engine(K, prefix_reuse=False, opened=_dflash()) as (e, decisions):
        alone = {i: _run(e, requests, [i])[i].token_ids for i in range(3)}
        assert max(p for p, _ in _decode_rows(decisions)) > 1  # sampled drafts were accepted
    with engine(K, opened=_dflash()) as (e, _):
        for order, arrival in (((4, 0, 3, 1, 2), "together"), ((2, 3, 1, 4, 0), "staggered")):
            got = _run(e, requests + fillers, order, arrival)
            assert {i: got[i].token_ids for i in range(3)} == alone, arrival


@pytest.mark.slow  # ~18 s: the default run's 15 minutes (MTP's stats: test_speculative_engine.py)
def test_stats_add_up_per_block_position():
    requests = _requests()[:4]
    with engine(K, opened=_dflash()) as (e, decisions):
        _run(e, requests, range(len(requests)))
        spec = e.stats().speculative
        rows = _decode_rows(decisions)
    assert (spec.method, spec.num_speculative_tokens) == ("dflash", K)
    assert spec.verify_rows == len(rows) > 0
    assert spec.committed_tokens == sum(a for _, a in rows)
    assert spec.mean_accepted_tokens == spec.committed_tokens / spec.verify_rows > 1.5
    assert len(spec.acceptance_by_position) == K
    rates = spec.acceptance_by_position
    assert rates[0] > 0.5 and all(0 <= r <= 1 for r in rates)


def test_bare_rounds_keep_greedy_output_and_drafting_resumes_after_them():
    """An adaptive Engine whose drafter's window (64) is shorter than its sequences: rounds
    whose rows draft nothing (speculative="off") skip the drafter's upkeep (bare rounds: the
    Program's count), requests that speculate after them on the same slots draft from whole
    contexts, and every output equals that of speculation off. (A sequence that drafts after
    its own bare rounds: tests/program/test_dflash_program.py.)"""
    opened = _opened(K, "dflash", tuple({**SETTINGS, "draft_policy": "adaptive",
                                         "max_seq_len": 256, "max_concurrency": 2}.items()))
    assert opened[0].limits.context_window == 64
    greedy = SamplingParams(temperature=0.0, max_new_tokens=150, ignore_eos=True)
    off = dataclasses.replace(greedy, speculative="off")
    texts = ["Once upon a time", "The dog ran to the"]
    with engine(K, opened=opened) as (e, _):
        want = [e.submit(prompt=t, sampling=off).result(120).token_ids for t in texts]
        bare = e.stats().speculative.bare_rounds
        assert bare >= 2 * 140
        handles = [e.submit(prompt=t, sampling=greedy) for t in texts]
        assert [h.result(120).token_ids for h in handles] == want
        spec = e.stats().speculative
    assert spec.verify_rows > 0 and spec.mean_accepted_tokens > 1.5
