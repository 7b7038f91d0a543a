"""lm-evaluation-harness's `local-completions` model against a live server: the log-likelihoods of
a small multiple-choice task equal the in-process `ninfer` adapter's within 1e-4.

The harness finds the server's tokenizer endpoints (`/tokenizer_info`, `/tokenize`, so its
`remote` backend), sends each (context, continuation) as token ids with `echo`, `logprobs: 1`,
`max_tokens: 1` (a list of prompts when batch_size > 1) and reads the continuation's prompt
log-probs. Those come from the server's scoring path: the dense fixture's CausalScoring
purpose, opened by `create_app` from the Engine's model directory, as `ninfer serve` does. The
one token the request generates, which lm-eval drops, comes from the FakeProgram. The harness's
own task run (datasets, task loading: heavy) is in the slow tier."""

from __future__ import annotations

import pytest
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI

from ninfer_jax.api import Engine
from ninfer_jax.engine import EngineCore, EngineCoreConfig
from ninfer_jax.frontend import Frontend
from ninfer_jax.gateway.lm_eval_adapter import NinferLM, local_choice_task
from ninfer_jax.program.limits import ProgramLimits
from ninfer_jax.testing.fake_program import FakeProgram
from tests.gateway.conftest import MODEL, PAGE_SIZE, served
from tests.scoring.conftest import model_dir  # noqa: F401  (the fixture)

MAX_LEN = 64  # the server's context (its scorer's window) and the adapter's
DOCS = [{"q": f"Q{i}: the cat", "choices": [" sat.", " ran away.", " slept."], "gold": i % 3}
        for i in range(4)]
PAIRS = [(d["q"], c) for d in DOCS for c in d["choices"]] + [("The cat ", "sat."),
                                                               ("", "Hello")]


@pytest.fixture(scope="module")
def adapter(model_dir):  # noqa: F811
    return NinferLM(model=str(model_dir), max_len=MAX_LEN, max_batch_tokens=4 * MAX_LEN)


@pytest.fixture(scope="module")
def url(adapter, model_dir):  # noqa: F811
    tokenizer = adapter.tokenizer_
    limits = ProgramLimits(
        max_seq_len=MAX_LEN, page_size=PAGE_SIZE, total_pages=4 * (MAX_LEN // PAGE_SIZE),
        total_slots=4, max_concurrency=4, prefill_chunk=64, vocab_size=tokenizer.vocab_size,
        total_checkpoint_slots=8)
    frontend = Frontend(tokenizer, None)
    program = FakeProgram(limits, eos_id=tokenizer.special_id("<|endoftext|>"))
    engine = Engine(EngineCore(program, frontend, EngineCoreConfig(idle_wait_s=0.01)),
                    frontend, model_dir)
    with served(engine) as server:
        yield server.url


def _instances(pairs):
    return [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i)
            for i, p in enumerate(pairs)]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_local_completions_loglikelihoods_equal_the_adapter(adapter, url, batch_size):
    client = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=MODEL,
                                 batch_size=batch_size, max_length=MAX_LEN)
    assert client.tokenizer_backend == "remote"  # found the server's tokenizer endpoints
    got = client.loglikelihood(_instances(PAIRS))
    want = adapter.loglikelihood(_instances(PAIRS))
    assert len(got) == len(want) == len(PAIRS)
    for (lp, greedy), (w_lp, w_greedy) in zip(got, want):
        assert lp == pytest.approx(w_lp, abs=1e-4) and greedy == w_greedy
    assert len({round(lp, 3) for lp, _ in got}) > len(PAIRS) // 2  # not one value repeated


@pytest.mark.slow  # the harness's task machinery (datasets, task loading) takes ~20 s
def test_a_local_multiple_choice_task_through_the_server(adapter, url, tmp_path):
    from lm_eval import simple_evaluate

    manager = local_choice_task(tmp_path, "ninfer_server_local", DOCS)
    client = LocalCompletionsAPI(base_url=f"{url}/v1/completions", model=MODEL, batch_size=3,
                                 max_length=MAX_LEN)
    runs = [simple_evaluate(model=m, tasks=["ninfer_server_local"], task_manager=manager,
                            log_samples=True) for m in (client, adapter)]
    got, want = ([[r[0] for r in s["filtered_resps"]] for s in run["samples"][
        "ninfer_server_local"]] for run in runs)
    assert len(got) == len(DOCS)
    for g, w in zip(got, want):  # each choice's log-likelihood
        assert len(g) == 3 and g == pytest.approx(w, abs=1e-4)
    assert runs[0]["results"]["ninfer_server_local"]["acc,none"] == \
        runs[1]["results"]["ninfer_server_local"]["acc,none"]
