"""Anthropic Messages requests (plain httpx) against a live server, checked against the Messages
schema: the official `anthropic` package's pydantic models for the message and every stream
event, plus the event order Anthropic documents."""

from __future__ import annotations

import json

import httpx
import pydantic
import pytest
from anthropic.types import Message, RawMessageStreamEvent

from ninfer_jax.sampling_params import SamplingParams
from tests.gateway.conftest import MODEL

EVENT = pydantic.TypeAdapter(RawMessageStreamEvent)
MESSAGES = [{"role": "user", "content": "hello"},
            {"role": "assistant", "content": [{"type": "text", "text": "hi"}]},
            {"role": "user", "content": [{"type": "text", "text": "and then?"}]}]


def flat(system: str | None = None) -> list[dict[str, str]]:
    out = [{"role": "system", "content": system}] if system else []
    return out + [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
                   else "".join(p["text"] for p in m["content"])} for m in MESSAGES]


def sse_events(text: str) -> list[tuple[str, dict]]:
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        events.append((lines["event"], json.loads(lines["data"])))
    return events


def test_message(server, engine_of):
    body = {"model": MODEL, "max_tokens": 12, "system": "be kind", "messages": MESSAGES,
            "temperature": 0.5, "top_p": 0.9, "top_k": 10, "metadata": {"user_id": "u1"}}
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert r.status_code == 200, r.text
    msg = Message.model_validate(r.json())
    want = engine_of(server).generate(messages=flat("be kind"), sampling=SamplingParams(
        max_new_tokens=12, temperature=0.5, top_p=0.9, top_k=10, seed=0))
    assert msg.role == "assistant" and msg.type == "message" and msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"]
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert msg.usage.input_tokens == want.usage.prompt_tokens
    assert msg.usage.output_tokens <= 12


def test_message_is_deterministic_with_the_engine(server, engine_of):
    """Anthropic has no seed; with temperature 0 the answer equals the Engine's greedy one."""
    r = httpx.post(f"{server.url}/v1/messages", timeout=30, json={
        "model": MODEL, "max_tokens": 16, "messages": MESSAGES, "temperature": 0})
    want = engine_of(server).generate(messages=flat(), sampling=SamplingParams(
        max_new_tokens=16, temperature=0))
    msg = Message.model_validate(r.json())
    assert msg.content[0].text == want.text
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
        want.finish_reason.value]


@pytest.mark.parametrize("thinking", [None, {"type": "enabled", "budget_tokens": 16}])
def test_stream_event_order(server, thinking):
    body = {"model": MODEL, "max_tokens": 24, "messages": MESSAGES, "stream": True,
            "temperature": 0}
    if thinking:
        body["thinking"] = thinking
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    for name, data in events:
        assert EVENT.validate_python(data).type == name
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    # blocks: start, deltas..., stop, in index order, never interleaved
    open_index, seen = None, []
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None
            open_index = data["index"]
            seen.append((data["index"], data["content_block"]["type"]))
        elif name == "content_block_delta":
            assert data["index"] == open_index
        else:
            assert name == "content_block_stop" and data["index"] == open_index
            open_index = None
    assert open_index is None and [i for i, _ in seen] == list(range(len(seen)))
    kinds = [k for _, k in seen]
    assert kinds in (["text"], ["thinking"], ["thinking", "text"])
    if not thinking:
        assert kinds == ["text"]
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in ("end_turn", "max_tokens")
    assert delta["usage"]["output_tokens"] >= 1


def test_thinking_budget_ends_the_block(server, engine_of):
    """budget_tokens: the thinking block holds at most that many sampled tokens, then the
    Frontend closes it and the answer goes on as text (the model alone closes it later)."""
    body = {"model": MODEL, "max_tokens": 12, "messages": MESSAGES, "temperature": 0,
            "thinking": {"type": "enabled", "budget_tokens": 2}}
    msg = Message.model_validate(httpx.post(f"{server.url}/v1/messages", json=body,
                                            timeout=30).json())
    assert [b.type for b in msg.content] == ["thinking", "text"]
    want = engine_of(server).generate(messages=flat(), enable_thinking=True, sampling=
                                      SamplingParams(max_new_tokens=12, temperature=0,
                                                     max_thinking_tokens=2))
    assert msg.content[0].thinking == want.reasoning_text and msg.content[1].text == want.text
    assert len(want.reasoning_text.strip()) <= 2 and want.text
    free = engine_of(server).generate(messages=flat(), enable_thinking=True, sampling=
                                      SamplingParams(max_new_tokens=12, temperature=0))
    assert len(free.reasoning_text.strip()) > 2  # without a budget the model thinks longer


def test_official_client_parses_the_stream(server):
    import anthropic

    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        with client.messages.stream(model=MODEL, max_tokens=10, messages=MESSAGES) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
        assert final.content[-1].text == text
        assert final.usage.output_tokens >= 1


@pytest.mark.parametrize("body, field", [
    ({"messages": MESSAGES}, "max_tokens"),
    ({"max_tokens": 5}, "messages"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
     "messages[0].content[0].source"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 5, "messages": MESSAGES, "temperature": "hot"}, "temperature"),
    ({"max_tokens": 5, "messages": MESSAGES, "stop_sequences": [""]}, "stop_sequences[0]"),
    ({"max_tokens": 0, "messages": MESSAGES}, "max_tokens"),
    ({"max_tokens": 5, "messages": MESSAGES, "thinking": {"type": "maybe"}}, "thinking.type"),
    ({"max_tokens": 5, "messages": MESSAGES, "thinking": {"type": "enabled"}},
     "thinking.budget_tokens"),
    ({"max_tokens": 5, "messages": MESSAGES, "thinking": {"type": "enabled",
                                                          "budget_tokens": 5}},
     "thinking.budget_tokens"),
    ({"max_tokens": 5, "messages": MESSAGES, "thinking": {"type": "disabled",
                                                          "budget_tokens": 2}},
     "thinking.budget_tokens"),
])
def test_errors_use_the_anthropic_schema(server, body, field):
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(field), err


def test_unknown_model_anthropic(server):
    r = httpx.post(f"{server.url}/v1/messages", timeout=30,
                   json={"model": "claude-x", "max_tokens": 5, "messages": MESSAGES})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_cache_read_input_tokens(server):
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0,
            "messages": [{"role": "user", "content": "a long enough opening turn"}]}
    first = Message.model_validate(httpx.post(f"{server.url}/v1/messages", json=body,
                                              timeout=30).json())
    body["messages"] += [{"role": "assistant", "content": first.content[0].text},
                         {"role": "user", "content": "next"}]
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    usage = Message.model_validate(r.json()).usage
    assert usage.cache_read_input_tokens > 0
    assert usage.input_tokens + usage.cache_read_input_tokens > first.usage.input_tokens


def test_matched_stop_sequence_is_reported(server, engine_of):
    want = engine_of(server).generate(messages=flat(), sampling=SamplingParams(
        max_new_tokens=24, temperature=0)).text
    stop = want[4:6]
    r = httpx.post(f"{server.url}/v1/messages", timeout=30, json={
        "model": MODEL, "max_tokens": 24, "messages": MESSAGES, "temperature": 0,
        "stop_sequences": [stop]})
    msg = Message.model_validate(r.json())
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == want[: want.index(stop)]
