"""Prefix reuse through the Engine (FakeProgram: its state is a hash of every consumed token, so
a wrong reuse changes the output): token identity with reuse off, cached_tokens, refcounts after
storms, eviction under pressure, backfill, and the switch."""

from __future__ import annotations

import contextlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer_jax.engine import EngineCore, EngineCoreConfig, FinishReason
from ninfer_jax.sampling_params import SamplingParams
from ninfer_jax.testing.fake_program import FakeProgram, expected_tokens
from tests.engine.conftest import FRONTEND, TOKENIZER, limits, settle
from tests.engine.invariants import assert_transactions_settled


@contextlib.contextmanager
def engine(max_concurrency=4, reuse=True, ckpt_slots=8, **limit_kw):
    kw = {"max_seq_len": 256, "total_pages": 64 * max_concurrency,
          "total_checkpoint_slots": ckpt_slots}
    program = FakeProgram(limits(max_concurrency, **{**kw, **limit_kw}), eos_id=None)
    core = EngineCore(program, FRONTEND, EngineCoreConfig(max_queue=64, idle_wait_s=0.005,
                                                          prefix_reuse=reuse))
    try:
        yield core, program
    finally:
        core.close()


def submit(core, ids, budget, seed=0, session=None):
    sp = SamplingParams(temperature=0.5 if seed else 0.0, seed=seed or None, max_new_tokens=budget)
    return core.submit(FRONTEND.prepare(prompt_token_ids=ids), sp, session_key=session)


def want(ids, budget, seed=0):
    return expected_tokens(list(ids), budget, seed=seed, vocab_size=TOKENIZER.vocab_size,
                           eos_id=None)


def refs_explained(program):
    held = {}
    for h in program.handles():
        for p in program._seq(h).pages:
            held[p] = held.get(p, 0) + 1
    for ck in program.checkpoints.records():
        for p in ck.pages:
            held[p] = held.get(p, 0) + 1
    return all(program.pages.refcount(p) == held.get(p, 0) for p in range(program.pages.num_pages))


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data(), concurrency=st.sampled_from([1, 3, 8]))
def test_multi_turn_outputs_equal_reuse_off(data, concurrency):
    systems = [list(range(40, 40 + n)) for n in (5, 19)]
    with engine(concurrency) as (core, program):
        histories = {}  # conversation -> token history so far
        for _ in range(data.draw(st.integers(2, 5), label="rounds")):
            handles = []
            for conv in range(data.draw(st.integers(1, 6), label="convs")):
                if conv in histories and data.draw(st.booleans(), label="branch"):
                    base = histories[conv][: data.draw(st.integers(1, len(histories[conv])))]
                else:
                    base = histories.get(conv, systems[conv % 2])
                user = data.draw(st.lists(st.integers(97, 122), min_size=1, max_size=12))
                ids = base + user
                budget = data.draw(st.integers(1, 10))
                seed = data.draw(st.sampled_from([0, 0, 7]))
                h = submit(core, ids, budget, seed, session=f"s{conv}")
                if data.draw(st.integers(0, 9)) == 0:
                    h.cancel()
                handles.append((conv, ids, budget, seed, h))
            for conv, ids, budget, seed, h in handles:
                r = h.result(timeout=30)
                got = list(r.token_ids)
                assert got == want(ids, budget, seed)[: len(got)]
                assert 0 <= r.usage.cached_tokens < len(ids)
                if r.finish_reason is FinishReason.CANCELLED:
                    continue
                assert got == want(ids, budget, seed)
                histories[conv] = ids + got
        assert settle(core).outstanding == 0
        assert refs_explained(program)
        assert_transactions_settled(core.stats(), program.stats().num_checkpoints)
        core.clear_prefix_cache()
        s = program.stats()
        assert s.free_pages == s.total_pages and s.num_checkpoints == 0 and s.num_sequences == 0
        assert_transactions_settled(settle(core), 0)


def test_follow_up_turns_report_the_whole_history_as_cached():
    with engine(2) as (core, _):
        history = list(range(60, 90))
        for extension in (1, 3, 9, 40):  # 1 token, less than a page (4), several pages
            r = submit(core, history, 6, session="chat").result(timeout=10)
            history = history + list(r.token_ids)
            frontier = len(history) - 1  # the last sampled token is not in the state yet
            ids = history + list(range(100, 100 + extension))
            r2 = submit(core, ids, 3, session="chat")
            first = next(iter(r2))
            assert first.cached_tokens == frontier
            res = r2.result(timeout=10)
            assert res.usage.cached_tokens == frontier
            assert list(res.token_ids) == want(ids, 3)
            history = ids + list(res.token_ids)
        stats = core.stats().prefix
        assert stats.hits >= 4 and stats.cached_tokens >= 4 * 30
        assert stats.checkpoints >= 1 and stats.pages_held >= 1


def test_reuse_off_caches_nothing():
    with engine(2, reuse=False) as (core, program):
        ids = list(range(60, 80))
        r = submit(core, ids, 4).result(timeout=10)
        r2 = submit(core, ids + list(r.token_ids) + [99], 4).result(timeout=10)
        assert r2.usage.cached_tokens == 0 and program.stats().num_checkpoints == 0


def test_eviction_under_pressure_never_fails_active_requests():
    # 24 pages of 4: each request needs up to 6 pages; checkpoints pin pages until evicted.
    with engine(2, ckpt_slots=6, total_pages=24, max_seq_len=24) as (core, program):
        handles = [submit(core, [10 + i] * 12, 8) for i in range(12)]
        for i, h in enumerate(handles):
            r = h.result(timeout=30)
            assert r.finish_reason is FinishReason.LENGTH and list(r.token_ids) == want(
                [10 + i] * 12, 8)
        assert core.stats().prefix.evictions > 0
        assert settle(core).outstanding == 0
        assert refs_explained(program)


def test_without_a_session_the_longest_cataloged_prefix_is_reused():
    with engine(2) as (core, _):
        stream = list(range(60, 110))
        for n in (10, 30, 20):  # budget 1: each leaves one checkpoint, at its prompt
            submit(core, stream[:n], 1).result(timeout=10)
        assert sorted(e.frontier for e in core.catalog.entries()) == [10, 20, 30]
        r = submit(core, stream, 4).result(timeout=10)
        assert r.usage.cached_tokens == 30 and list(r.token_ids) == want(stream, 4)
        r = submit(core, stream[:25] + [1, 2], 4).result(timeout=10)
        assert r.usage.cached_tokens == 20 and list(r.token_ids) == want(stream[:25] + [1, 2], 4)


def test_backfill_admits_small_requests_without_starving_the_head():
    # 16 pages of 4. Incumbent: 40 tokens (10 pages). Head: 40 tokens, blocked.
    # Small requests (2 pages) may borrow: 10 + 10 would not fit with the incumbent, but
    # head (10) + borrower (2) <= 16 once the incumbent finishes.
    with engine(3, reuse=False, total_pages=16, max_seq_len=48) as (core, program):
        gate = program.pause("after_decode")  # the incumbent is active and decoding
        incumbent = submit(core, list(range(60, 90)), 10)
        gate.wait()
        head = submit(core, list(range(100, 130)), 10)
        small = [submit(core, [120 + i, 121], 6) for i in range(3)]
        gate.release()
        results = [h.result(timeout=30) for h in [incumbent, head, *small]]
        assert all(r.finish_reason is FinishReason.LENGTH for r in results)
        assert core.scheduler.protected is None and core.stats().backfilled >= 1


def test_an_exact_repeat_runs_only_the_prompts_last_chunk():
    """The same prompt sent again (a retry, a regenerate) reuses the checkpoint its first send
    left at the start of its last prefill chunk, and runs only that chunk; the first send ran
    no extra chunk to leave it."""
    with engine(2) as (core, program):
        ids = list(range(60, 101))  # 41 tokens: chunks of 8 at 0, 8, ..., 40
        first = submit(core, ids, 4).result(timeout=10)
        assert first.usage.cached_tokens == 0 and program.prefilled_tokens == 41
        assert program.num_steps == 6 + 3  # six prefill chunks (none extra), three rounds
        before = program.prefilled_tokens
        second = submit(core, ids, 4).result(timeout=10)
        assert second.usage.cached_tokens == 40 and program.prefilled_tokens - before == 1
        assert list(second.token_ids) == list(first.token_ids) == want(ids, 4)
