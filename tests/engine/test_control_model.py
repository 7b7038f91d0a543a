"""Forced control on the real Program (the demo model, MTP off and K = 2): a thinking budget
closes the block at exactly the budget, and what is sampled after the forced suffix is what a
request whose prompt already held the thinking and the suffix samples (the draw is keyed by the
token's position; the forced tokens are in the state as prompt tokens would be). Shares the
compiled Programs of `test_speculative_engine.py`."""

from __future__ import annotations

import pytest

from ninfer_jax.sampling_params import SamplingParams
from tests.engine.test_speculative_engine import _opened, engine

PROMPT = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n<think>\nOnce upon a time"


def _suffix(frontend) -> list[int]:
    tok = frontend.tokenizer
    return [*tok.encode("\n"), tok.think_ids[1], *tok.encode("\n\n")]


# with MTP in the slow tier (~20 s): forced control text with speculation is
# test_structured_engine.py's test_text_the_grammar_forces_goes_in_as_forced_control
@pytest.mark.parametrize("k", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_thinking_budget_forces_the_end_and_then_samples_as_a_prompt_holding_it(k,
                                                                                    temperature):
    frontend = _opened(k)[1]
    suffix = _suffix(frontend)
    budget, new = 6, 24
    sampling = SamplingParams(temperature=temperature, seed=11, max_new_tokens=new,
                              max_thinking_tokens=budget)
    with engine(k) as (e, _):
        first = e.submit(prompt=PROMPT, sampling=sampling).result(timeout=120)
        ids = list(first.token_ids)
        assert ids[budget:budget + len(suffix)] == suffix, ids
        assert frontend.tokenizer.think_ids[1] not in ids[:budget]
        prompt_ids = list(frontend.prepare(prompt=PROMPT).token_ids)
        held = e.submit(prompt_token_ids=prompt_ids + ids[:budget + len(suffix)],
                        sampling=SamplingParams(temperature=temperature, seed=11,
                                                max_new_tokens=new - budget - len(suffix))
                        ).result(timeout=120)
        assert list(held.token_ids) == ids[budget + len(suffix):]
        assert first.text.endswith(held.text) and first.reasoning_text
