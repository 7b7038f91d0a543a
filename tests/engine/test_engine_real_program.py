"""The Engine over the real Program on the tiny transformers fixture: outputs at any concurrency
and arrival order equal single-request outputs (greedy: the model's reference greedy tokens)."""

from __future__ import annotations

from ninfer_jax.engine import EngineCore, EngineCoreConfig, FinishReason
from ninfer_jax.frontend import Frontend
from ninfer_jax.sampling_params import SamplingParams
from ninfer_jax.testing.tokenizer import ByteTokenizer
from tests.models.conftest import reference
from tests.program.conftest import program, reference_greedy

TOKENIZER = ByteTokenizer(vocab_size=384)


def _run(prompts, samplings, order, max_queue=32):
    core = EngineCore(program(), Frontend(TOKENIZER), EngineCoreConfig(max_queue=max_queue))
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
