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
        stats = program().stats()
    finally:
        core.close()
    return results, stats


def test_outputs_do_not_depend_on_concurrency_or_arrival_order():
    ids = reference("dense")["token_ids"]
    prompts = [ids[i % 3, : 4 + 3 * i].tolist() for i in range(10)]
    samplings = [SamplingParams(temperature=0.0 if i % 3 else 0.8, top_k=40, seed=100 + i,
                                max_new_tokens=6 + i % 4) for i in range(10)]
    concurrent, stats = _run(prompts, samplings, order=[9, 3, 0, 7, 1, 5, 2, 8, 6, 4])
    assert stats.free_pages == stats.total_pages and stats.num_sequences == 0
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
