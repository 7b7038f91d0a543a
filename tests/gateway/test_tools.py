"""Tool calls with the real clients, the real Qwen3.5/3.6 chat template and a scripted model
(`scripted.py`): OpenAI chat (whole, streamed as argument deltas, a tool round trip with
`content: null`), the Anthropic SDK (tool_use / tool_result round trip, streamed input JSON),
the Responses API (function_call items in and out); the prompts the model saw are the template's
rendering of the history; malformed calls come back as text; tool_choice none hides the tools."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.gateway.conftest import MODEL, served
from tests.gateway.scripted import QWEN_FRONTEND, scripted_engine
from tests.gateway.test_openai_client import strict

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"},
                                                    "metric": {"type": "boolean"}},
                   "required": ["city"]}}}]
CALL = ("Let me look.\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n"
        "</parameter>\n</function>\n</tool_call>")
ARGS = {"city": "Paris", "days": 3, "metric": True}


def reply(prompt: str) -> str:
    last = prompt.rsplit("<|im_start|>", 1)[0]
    if "<tool_response>" in last.rsplit("<|im_start|>user", 1)[-1]:
        return "It is sunny in Paris."
    if "think anyway" in last:  # a block the model opens though the prompt closed thinking
        return "<think>\nShould I think here?\n</think>\n\nHello anyway."
    if "broken" in last:
        return "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</tool_call>"
    if "weather" in last:
        return CALL
    return "Hello there."


@pytest.fixture(scope="module")
def live():
    engine = scripted_engine(reply, max_seq_len=4096)  # room for tools and a thinking budget
    with served(engine) as s:
        yield s, engine


@pytest.fixture(scope="module")
def oa(live):
    with openai.OpenAI(base_url=f"{live[0].url}/v1", api_key="x", max_retries=0,
                       timeout=30) as c:
        yield c


def _prompts(live) -> list[str]:
    return live[1].core.program.prompts


def test_chat_tool_call(live, oa):
    resp = strict(ChatCompletion, oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS,
        extra_body={"enable_thinking": False}))
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGS
    want = QWEN_FRONTEND.prepare(messages=[{"role": "user", "content": "weather in Paris?"}],
                                 tools=TOOLS, enable_thinking=False).text
    assert _prompts(live)[-1] == want and "# Tools" in want


def test_chat_tool_call_streamed_as_argument_deltas(live, oa):
    chunks = [strict(ChatCompletionChunk, c) for c in oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
        stream=True)]
    deltas = [c.choices[0].delta for c in chunks]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather"
    pieces = [tc.function.arguments for tc in calls]
    assert len(pieces) >= 4  # the opening delta and one per parameter
    assert json.loads("".join(pieces)) == ARGS
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == \
        "I should think."
    assert "".join(d.content or "" for d in deltas).lstrip("\n") == "Let me look."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_chat_tool_round_trip(live, oa):
    first = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather in Paris?"}], tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": call.id, "type": "function", "function": {
                       "name": call.function.name, "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"}]
    second = oa.chat.completions.create(model=MODEL, messages=history, tools=TOOLS)
    assert second.choices[0].message.content == "It is sunny in Paris."
    assert second.choices[0].finish_reason == "stop"
    rendered = QWEN_FRONTEND.prepare(messages=[
        history[0], {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": "get_weather", "arguments": ARGS}}]},
        history[2]], tools=TOOLS).text
    assert _prompts(live)[-1] == rendered
    assert "<parameter=days>\n3\n</parameter>" in rendered and "sunny, 21C" in rendered


def test_malformed_call_is_text_and_tool_choice_none(live, oa):
    resp = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "broken weather"}], tools=TOOLS,
        extra_body={"enable_thinking": False})
    assert resp.choices[0].message.tool_calls is None
    assert resp.choices[0].message.content.startswith("<tool_call>")
    assert resp.choices[0].finish_reason == "stop"
    none = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
        tool_choice="none", extra_body={"enable_thinking": False})
    assert none.choices[0].message.tool_calls is None and "# Tools" not in _prompts(live)[-1]
    assert none.choices[0].message.content == CALL  # not parsed: the tools were not offered


@pytest.mark.parametrize("kwargs, param", [
    ({"tool_choice": "required", "extra_body": {"enable_thinking": True}}, "enable_thinking"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    # #41: names outside [A-Za-z0-9_-]{1,64} and invalid schemas were accepted
    *[({"tools": [{"type": "function", "function": {"name": name, "parameters": {}}}]},
       "tools[0].function.name")
      for name in ("get weather", 'say"hi"', "<|im_end|>", "x" * 65, "")],
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters"),
])
def test_tool_refusals(oa, kwargs, param):
    kwargs.setdefault("tools", TOOLS)
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                   **kwargs)
    assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        oa.chat.completions.create(model=MODEL, tools=TOOLS, messages=[
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{not json"}}]}])
    assert e.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather of a city",
                    "input_schema": TOOLS[0]["function"]["parameters"]}]


@pytest.fixture(scope="module")
def an(live):
    with anthropic.Anthropic(base_url=live[0].url, api_key="x", max_retries=0,
                             timeout=30) as c:
        yield c


def test_anthropic_tool_round_trip(live, an):
    first = an.messages.create(model=MODEL, max_tokens=300, tools=ANTHROPIC_TOOLS,
                               messages=[{"role": "user", "content": "weather in Paris?"}])
    assert first.stop_reason == "tool_use"
    kinds = [b.type for b in first.content]
    assert kinds == ["text", "tool_use"]  # no thinking block: the request did not ask
    use = first.content[1]
    assert use.name == "get_weather" and use.input == ARGS
    history = [{"role": "user", "content": "weather in Paris?"},
               {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                 for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "sunny, 21C"}]}]
    second = an.messages.create(model=MODEL, max_tokens=300, tools=ANTHROPIC_TOOLS,
                                messages=history)
    assert second.stop_reason == "end_turn"
    assert second.content[0].text == "It is sunny in Paris."
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in _prompts(live)[-1]
    with an.messages.stream(model=MODEL, max_tokens=300, tools=ANTHROPIC_TOOLS,
                            messages=[{"role": "user", "content": "weather?"}]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and final.content[-1].input == ARGS


THINKING = {"type": "enabled", "budget_tokens": 1024}


def test_anthropic_thinking_sent_back_re_enters_the_template(live, an):
    """A tool loop with thinking on: the reply's thinking block goes back verbatim and its text
    is that turn's reasoning in the template (the Qwen template shows the reasoning of the turns
    after the last user query); a redacted_thinking block is accepted and dropped."""
    first = an.messages.create(model=MODEL, max_tokens=1200, tools=ANTHROPIC_TOOLS,
                               thinking=THINKING,
                               messages=[{"role": "user", "content": "weather in Paris?"}])
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    assert first.content[0].thinking == "I should think."
    use = first.content[2]
    sent = [b.model_dump(exclude_none=True) for b in first.content]
    for blocks in (sent, [{"type": "redacted_thinking", "data": "opaque"}, *sent]):
        history = [{"role": "user", "content": "weather in Paris?"},
                   {"role": "assistant", "content": blocks},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": "sunny, 21C"}]}]
        second = an.messages.create(model=MODEL, max_tokens=1200, tools=ANTHROPIC_TOOLS,
                                    thinking=THINKING, messages=history)
        assert [b.type for b in second.content] == ["thinking", "text"]
        assert second.content[1].text == "It is sunny in Paris."
        want = QWEN_FRONTEND.prepare(messages=[
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": first.content[1].text,
             "reasoning_content": "I should think.", "tool_calls": [
                 {"id": use.id, "type": "function",
                  "function": {"name": "get_weather", "arguments": ARGS}}]},
            {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21C"}],
            tools=TOOLS, enable_thinking=True).text
        assert _prompts(live)[-1] == want
        assert "<|im_start|>assistant\n<think>\nI should think.\n</think>\n\n" in want
    with pytest.raises(anthropic.BadRequestError) as e:  # a user has no thinking blocks
        an.messages.create(model=MODEL, max_tokens=100, messages=[
            {"role": "user", "content": [{"type": "thinking", "thinking": "x",
                                          "signature": ""}]}])
    assert "messages[0].content[0].type" in str(e.value)


def test_anthropic_without_thinking_field_streams_no_thinking_block(live, an):
    with an.messages.stream(model=MODEL, max_tokens=300,
                            messages=[{"role": "user", "content": "hi"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["text"] and [b.type for b in final.content] == ["text"]
    assert final.content[0].text == "Hello there." and final.stop_reason == "end_turn"
    assert _prompts(live)[-1].endswith("<think>\n\n</think>\n\n")  # thinking off
    off = an.messages.create(model=MODEL, max_tokens=300, thinking={"type": "disabled"},
                             messages=[{"role": "user", "content": "hi"}])
    assert [b.type for b in off.content] == ["text"]
    assert _prompts(live)[-1].endswith("<think>\n\n</think>\n\n")


def test_anthropic_without_thinking_never_shows_a_block_the_model_opens_anyway(live, an):
    """Thinking not asked: the prompt closes the block, and if the model (sampling) still opens
    one, Messages shows only the answer, streamed or whole (a client that did not ask for
    thinking gets no thinking block); asked, the block is there."""
    ask = [{"role": "user", "content": "think anyway"}]
    with an.messages.stream(model=MODEL, max_tokens=300, messages=ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert _prompts(live)[-1].endswith("<think>\n\n</think>\n\n")  # thinking off
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["text"]
    whole = an.messages.create(model=MODEL, max_tokens=300, messages=ask)
    for message in (final, whole):
        assert [(b.type, b.text) for b in message.content] == [("text", "Hello anyway.")]
    on = an.messages.create(model=MODEL, max_tokens=2000, messages=ask, thinking=THINKING)
    assert [b.type for b in on.content] == ["thinking", "text"]


@pytest.mark.parametrize("thinking", [None, THINKING])
def test_anthropic_five_turns_sending_every_reply_back(live, an, thinking):
    """Each reply goes back verbatim (thinking blocks included); without `thinking` no turn
    thinks and no reply has a thinking block."""
    extra = {} if thinking is None else {"thinking": thinking}
    history: list[dict] = []
    for turn in range(5):
        history.append({"role": "user", "content": f"turn {turn}: hi"})
        msg = an.messages.create(model=MODEL, max_tokens=1200, messages=history, **extra)
        kinds = [b.type for b in msg.content]
        assert kinds == (["text"] if thinking is None else ["thinking", "text"]), kinds
        assert msg.content[-1].text == "Hello there."
        history.append({"role": "assistant",
                        "content": [b.model_dump(exclude_none=True) for b in msg.content]})
        prompt = _prompts(live)[-1]
        assert prompt.endswith("<think>\n\n</think>\n\n" if thinking is None else "<think>\n")
    assert an.messages.count_tokens(model=MODEL, messages=history[:-1], **extra
                                    ).input_tokens == len(QWEN_FRONTEND.prepare(
                                        messages=_template_history(history[:-1]),
                                        enable_thinking=thinking is not None).token_ids)


def _template_history(history: list[dict]) -> list[dict]:
    out = []
    for m in history:
        if isinstance(m["content"], str):
            out.append(m)
            continue
        text = "".join(b.get("text", "") for b in m["content"])
        thought = "".join(b.get("thinking", "") for b in m["content"])
        out.append({"role": m["role"], "content": text,
                    **({"reasoning_content": thought} if thought else {})})
    return out


def test_responses_plain_streamed_and_tools(live, oa):
    r = oa.responses.create(model=MODEL, input="hi", instructions="be brief",
                            max_output_tokens=100)
    assert r.status == "completed" and r.output_text == "Hello there."
    assert r.usage.input_tokens > 0 and r.usage.output_tokens == len("Hello there.") + 1
    assert "<|im_start|>system\nbe brief<|im_end|>" in _prompts(live)[-1]
    with oa.responses.stream(model=MODEL, input="hi", max_output_tokens=100,
                             reasoning={"effort": "low"}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output_text == "Hello there."
    flat = [{"type": "function", "name": "get_weather",
             "parameters": TOOLS[0]["function"]["parameters"]}]
    called = oa.responses.create(model=MODEL, input="weather in Paris?", tools=flat,
                                 max_output_tokens=300)
    call = next(o for o in called.output if o.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGS
    after = oa.responses.create(model=MODEL, tools=flat, max_output_tokens=300, input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}])
    assert after.output_text == "It is sunny in Paris."
    with oa.responses.stream(model=MODEL, input="weather?", tools=flat,
                             max_output_tokens=300) as stream:
        kinds = [e.type for e in stream]
    assert "response.function_call_arguments.delta" in kinds
    with pytest.raises(openai.BadRequestError) as e:
        oa.responses.create(model=MODEL, input="hi", previous_response_id="resp_1")
    assert e.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("tool, param", [
    ({"name": "get_weather"}, "tools[0].input_schema"),  # #41: accepted without a schema
    ({"name": "get weather", "input_schema": {"type": "object"}}, "tools[0].name"),
    ({"name": "f", "input_schema": {"type": "nope"}}, "tools[0].input_schema"),
])
def test_anthropic_tool_refusals(an, tool, param):
    with pytest.raises(anthropic.BadRequestError) as e:
        an.messages.create(model=MODEL, max_tokens=10, tools=[tool],
                           messages=[{"role": "user", "content": "x"}])
    assert param in str(e.value), e.value
