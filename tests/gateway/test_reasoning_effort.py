"""OpenAI `reasoning_effort` (chat) and `reasoning.effort` (Responses) through the official client:
"none" renders the prompt with thinking off, "low" / "medium" think under a budget of 1024 /
4096 tokens (the SamplingParams the Program receives carry it), "high" thinks without a budget;
any other effort, or one contradicting an explicit enable_thinking / max_thinking_tokens, is a
400 naming the field."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.conftest import MODEL, THINK_END, THINK_START, make_engine, served

MESSAGES = [{"role": "user", "content": "think about it"}]
EXPECTED = {"none": (False, None), "low": (True, 1024), "medium": (True, 4096),
            "high": (True, None)}


@pytest.fixture(scope="module")
def live():
    engine = make_engine(max_seq_len=256)
    seen = []  # (prompt leaves <think> open, max_thinking_tokens) of every materialized row
    engine.core.program.on("after_materialize", lambda seqs: seen.extend(
        (s.tokens[s.prompt_len - 2:s.prompt_len].count(THINK_START) == 1
         and THINK_END not in s.tokens[s.prompt_len - 2:s.prompt_len],
         s.sampling.max_thinking_tokens) for s in seqs))
    with served(engine) as s, openai.OpenAI(base_url=f"{s.url}/v1", api_key="x",
                                            max_retries=0, timeout=30) as client:
        yield client, seen


@pytest.mark.parametrize("effort", list(EXPECTED))
def test_chat_reasoning_effort(live, effort):
    client, seen = live
    # A fixed seed: the fake model ends with EOS now and then, at random seeds within the
    # three thinking tokens about once in a hundred runs.
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                          reasoning_effort=effort, seed=1)
    thinks, budget = EXPECTED[effort]
    assert seen[-1] == (thinks, budget)
    reasoning = getattr(resp.choices[0].message, "reasoning_content", None)
    assert bool(reasoning) == thinks  # the fake model thinks 3 tokens when the prompt lets it


@pytest.mark.parametrize("effort", list(EXPECTED))
def test_responses_reasoning_effort(live, effort):
    client, seen = live
    r = client.responses.create(model=MODEL, input="think about it", max_output_tokens=12,
                                reasoning={"effort": effort}, extra_body={"seed": 1})
    thinks, budget = EXPECTED[effort]
    assert seen[-1] == (thinks, budget)
    assert [o.type for o in r.output] == (["reasoning", "message"] if thinks else ["message"])
    assert r.reasoning.effort == effort


def test_responses_reasoning_without_effort_thinks_without_budget(live):
    client, seen = live
    client.responses.create(model=MODEL, input="x", max_output_tokens=4, reasoning={})
    assert seen[-1] == (True, None)
    client.responses.create(model=MODEL, input="x", max_output_tokens=4)
    assert seen[-1] == (False, None)  # no `reasoning`: no thinking


@pytest.mark.parametrize("extra, param", [
    ({"reasoning_effort": "minimal"}, "reasoning_effort"),
    ({"reasoning_effort": "max"}, "reasoning_effort"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
    ({"reasoning_effort": "none", "enable_thinking": True}, "reasoning_effort"),
    ({"reasoning_effort": "high",
      "chat_template_kwargs": {"enable_thinking": False}}, "reasoning_effort"),
    ({"reasoning_effort": "low", "max_thinking_tokens": 8}, "reasoning_effort"),
])
def test_chat_reasoning_effort_refusals(live, extra, param):
    client, _ = live
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                       extra_body=extra)
    assert e.value.body["param"] == param, e.value.body


def test_chat_reasoning_effort_agreeing_with_enable_thinking(live):
    client, seen = live
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4,
                                   extra_body={"reasoning_effort": "low",
                                               "enable_thinking": True})
    assert seen[-1] == (True, 1024)


@pytest.mark.parametrize("effort", ["minimal", "xhigh", ""])
def test_responses_reasoning_effort_refusals(live, effort):
    client, _ = live
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", max_output_tokens=4,
                                reasoning={"effort": effort})
    assert e.value.body["param"] == "reasoning.effort", e.value.body


@pytest.mark.parametrize("reasoning, param", [
    ({"effort": "low", "summary": "auto"}, "reasoning.summary"),
    ({"generate_summary": "concise"}, "reasoning.generate_summary"),
    ({"budget": 5}, "reasoning.budget"),
])
def test_responses_reasoning_summaries_and_unknown_fields_refused(live, reasoning, param):
    client, _ = live
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="x", max_output_tokens=4,
                                reasoning=reasoning)
    assert e.value.body["param"] == param, e.value.body
