"""The `ninfer` lm-evaluation-harness model: its answers against the Scorer and our own greedy
oracle, and a local multiple-choice task run by the harness itself (local data, no network; in
the slow tier). lm-eval is in the test extra (it installs without torch), so these run in the
default tier; without it they fail at import, never skip."""

from __future__ import annotations


import numpy as np
import pytest
from lm_eval.api.instance import Instance

from ninfer_jax.gateway.lm_eval_adapter import NinferLM, local_choice_task
from tests.program.conftest import reference_greedy
from tests.scoring.conftest import WIDTH, scorer

SHAPE = {"max_batch_tokens": 3 * WIDTH}  # the scoring tests' window executable


@pytest.fixture(scope="module")
def lm(model_dir):
    return NinferLM(model=str(model_dir), max_len=WIDTH, max_concurrency=1, max_seq_len=64,
                    batch_size=1, **SHAPE)


def _instances(kind, args):
    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args)]


def test_loglikelihood_matches_the_scorer(lm):
    pairs = [("The cat", " sat."), ("The cat ", "sat."), ("", "Hello"), ("x" * 60, " end")]
    got = lm.loglikelihood(_instances("loglikelihood", pairs))
    sc = scorer("dense")
    prefix = lm.prefix_token_id
    want = [sc.score(texts=[" sat."], contexts=["The cat"])[0],
            sc.score(texts=[" sat."], contexts=["The cat"])[0],
            sc.score(token_ids=[list(b"Hello")], contexts=[[prefix]])[0],
            sc.score(texts=[" end"], contexts=["x" * 60])[0]]  # context cut from the left
    # equal to each pair scored alone up to rounding: the adapter's batch shares the first two
    # pairs' context and packs the others in a row (tests/scoring/test_sharing.py)
    for (lp, greedy), w in zip(got, want):
        assert lp == pytest.approx(w.sum_logprob, rel=1e-6) and greedy == w.is_greedy


def test_loglikelihood_rolling_matches_rolling_windows(model_dir):
    lm = NinferLM(model=str(model_dir), window=WIDTH, **SHAPE)
    text = "Once upon a time there was a cat. " * 4
    [got] = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(text,)]))
    [want] = scorer("dense", window=WIDTH).score(token_ids=[[lm.prefix_token_id, *text.encode()]])
    assert want.num_tokens == len(text)
    assert got == pytest.approx(want.sum_logprob, rel=1e-12)


def test_generate_until_is_greedy_and_stops(lm):
    prompts = ["Once upon", "The cat"]
    reqs = _instances("generate_until", [(p, {"until": ["\x00never"], "max_gen_toks": 6})
                                         for p in prompts])
    got = lm.generate_until(reqs)
    for p, text in zip(prompts, got):
        want = reference_greedy("dense", list(p.encode()), 6)
        assert text == lm.tok_decode(want)
    stop = got[0][2:4]
    [cut] = lm.generate_until(_instances("generate_until", [(prompts[0], {"until": [stop],
                                                                          "max_gen_toks": 6})]))
    assert cut == got[0][: got[0].index(stop)]


@pytest.mark.slow  # the harness's own start-up (datasets, task loading) takes ~20 s
def test_a_local_multiple_choice_task_runs_through_the_harness(lm, tmp_path):
    from lm_eval import simple_evaluate

    docs = [{"q": f"Q{i}: the cat", "choices": [" sat.", " ran.", " slept."], "gold": i % 3}
            for i in range(6)]
    manager = local_choice_task(tmp_path, "ninfer_local", docs)
    out = simple_evaluate(model=lm, tasks=["ninfer_local"], task_manager=manager)
    acc = out["results"]["ninfer_local"]["acc,none"]
    sc = scorer("dense")
    # the harness scores target_delimiter (" ") + choice after the question
    want = np.mean([int(np.argmax([sc.score(texts=[" " + c], contexts=[d["q"]])[0].sum_logprob
                                   for c in d["choices"]]) == d["gold"]) for d in docs])
    assert acc == pytest.approx(want)
