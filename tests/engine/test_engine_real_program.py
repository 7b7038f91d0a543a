"""The Engine over the real Program on the tiny transformers fixture: outputs at any concurrency
and arrival order equal single-request outputs (greedy: the model's reference greedy tokens),
with rounds dispatched ahead (overlap, the default) or not."""

from __future__ import annotations

from ninfer_jax.engine import EngineCore, EngineCoreConfig, FinishReason
from ninfer_jax.frontend import Frontend
from ninfer_jax.sampling_params import SamplingParams
from ninfer_jax.testing.tokenizer import ByteTokenizer
from tests.models.conftest import reference
from tests.program.conftest import program, reference_greedy

TOKENIZER = ByteTokenizer(vocab_size=384)


def _run(prompts, samplings, order, max_queue=32, overlap=True):
    core = EngineCore(program(), Frontend(TOKENIZER),
                      EngineCoreConfig(max_queue=max_queue, overlap=overlap))
    try:
        handles = {i: core.submit(Frontend(TOKENIZER).prepare(prompt_token_ids=prompts[i]),
                                  samplings[i]) for i in order}
        results = {i: h.result(timeout=120) for i, h in handles.items()}
        _run.last_prefix_stats = core.stats().prefix
    finally:
        core.close()  # releases the Engine's checkpoints too
    return results, program().stats()


def test_outputs_do_not_depend_on_concurrency_or_arrival_order():
    ids = reference("dense")["token_ids"]
    prompts = [ids[i % 3, : 4 + 3 * i].tolist() for i in range(10)]
    samplings = [SamplingParams(temperature=0.0 if i % 3 else 0.8, top_k=40, seed=100 + i,
                                max_new_tokens=6 + i % 4) for i in range(10)]
    concurrent, stats = _run(prompts, samplings, order=[9, 3, 0, 7, 1, 5, 2, 8, 6, 4])
    assert stats.free_pages == stats.total_pages and stats.num_sequences == 0
    assert _run.last_prefix_stats.hits >= 1  # later prompts extend earlier ones
    for i in range(10):
        single, _ = _run([prompts[i]], [samplings[i]], order=[0])
        got = list(concurrent[i].token_ids)
        assert got == list(single[0].token_ids)
        if samplings[i].temperature == 0:
            assert got == reference_greedy("dense", prompts[i], len(got))
        if concurrent[i].finish_reason is FinishReason.STOP:
            assert got[-1] in TOKENIZER.eos_ids
        else:
            assert len(got) == samplings[i].max_new_tokens


def test_overlap_on_and_off_give_the_same_tokens_at_every_batch():
    """Rounds dispatched before the last one is processed (their tokens taken on the device)
    and rows whose output ends inside a round ahead (a stop string taken from the middle of
    its own text; budgets): the same tokens as without overlap, at B = 1..4, greedy and
    sampled; nothing leaks."""
    ids = reference("dense")["token_ids"]
    for b in (1, 2, 4):
        prompts = [ids[i % 3, : 5 + 2 * i].tolist() for i in range(b)]

        def settings(stops):
            return [SamplingParams(temperature=0.0 if i % 2 == 0 else 0.9, top_p=0.9,
                                   seed=7 + i, max_new_tokens=12 + 3 * i, ignore_eos=True,
                                   skip_special_tokens=False, stop=stop)
                    for i, stop in enumerate(stops)]

        free, _ = _run(prompts, settings([()] * b), order=list(range(b)), overlap=False)
        # Every other row stops at text from the middle of its own answer.
        stops = [(free[i].text[len(free[i].text) // 2:][:2],) if i % 2 == 0
                 and len(free[i].text) > 4 else () for i in range(b)]
        on, stats = _run(prompts, settings(stops), order=list(range(b)), overlap=True)
        assert stats.free_pages == stats.total_pages and stats.num_sequences == 0
        off, _ = _run(prompts, settings(stops), order=list(range(b)), overlap=False)
        for i in range(b):
            assert on[i].token_ids == off[i].token_ids, (b, i)
            assert on[i].text == off[i].text and on[i].finish_reason is off[i].finish_reason
        assert any(r.finish_reason is FinishReason.STOP for r in on.values())


def test_round_stats_count_rounds_rows_and_host_time():
    ids = reference("dense")["token_ids"]
    core = EngineCore(program(), Frontend(TOKENIZER), EngineCoreConfig())
    try:
        sp = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
        handles = [core.submit(Frontend(TOKENIZER).prepare(prompt_token_ids=ids[i, :6].tolist()),
                               sp) for i in range(2)]
        for h in handles:
            h.result(timeout=120)
        r = core.stats().rounds
    finally:
        core.close()
    # 2 x 7 decode tokens (the first comes from the prefill) in rounds of 1 or 2 rows; a round
    # ahead dropped when a row ends counts too.
    assert 7 <= r.rounds <= 16 and 14 <= r.rows <= 18
    assert r.host_s > 0 and r.wait_s >= 0 and r.host_us_per_row <= r.host_us_per_round


def test_multi_turn_reuse_on_the_real_model_equals_recompute():
    ids = reference("dense")["token_ids"][0].tolist()
    core = EngineCore(program(), Frontend(TOKENIZER), EngineCoreConfig())
    try:
        history = ids[:10]
        for extension in (ids[10:11], ids[11:14], ids[14:25]):
            sp = SamplingParams(temperature=0.0, max_new_tokens=5, stop=())
            first = core.submit(Frontend(TOKENIZER).prepare(prompt_token_ids=history), sp,
                                session_key="s").result(timeout=120)
            history = history + list(first.token_ids) + extension
            r = core.submit(Frontend(TOKENIZER).prepare(prompt_token_ids=history), sp,
                            session_key="s").result(timeout=120)
            if first.finish_reason is FinishReason.LENGTH:
                assert r.usage.cached_tokens == len(history) - len(extension) - 1
            assert list(r.token_ids) == reference_greedy("dense", history, len(r.token_ids))
            history = history + list(r.token_ids)
    finally:
        core.close()
