"""Structured output with the real clients against a live server over the FakeProgram (whose
tokens, under a mask, are replaced by allowed ones: `FakeProgram._allowed`), so every answer
below is the grammar's doing: `chat.completions.parse` with a Pydantic model, json_object,
guided_choice / guided_regex / guided_json / structured_outputs, the Responses API's
`text.format`, tool_choice required / named (OpenAI) and any / tool (Anthropic) producing parsed
tool calls; bad specs and contradicting fields are 400s naming the field."""

from __future__ import annotations

import json
import re
from typing import Literal

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from tests.gateway.conftest import MODEL, make_engine, served
from tests.gateway.scripted import scripted_engine

SEEDS = range(4)


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user"]
    tags: list[Literal["a", "b"]] = Field(max_length=2)


def person_schema() -> dict:
    """Person's JSON schema, closed (as `parse()` sends it): no other properties."""
    return {**Person.model_json_schema(), "additionalProperties": False}


@pytest.fixture(scope="module")
def server():
    with served(make_engine()) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                       timeout=30) as c:
        yield c


def _chat(client, **kw):
    kw.setdefault("max_tokens", 200)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "go"}], **kw)


@pytest.mark.parametrize("seed", SEEDS)
def test_parse_with_pydantic_model(client, seed):
    out = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "a person"}], response_format=Person,
        max_tokens=200, temperature=1.0, seed=seed)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object(client):
    for seed in SEEDS:
        text = _chat(client, response_format={"type": "json_object"}, seed=seed,
                     temperature=1.0, max_tokens=400).choices[0]
        if text.finish_reason == "stop":  # any JSON object may be long: parse the ended ones
            assert isinstance(json.loads(text.message.content), dict)
        else:
            assert text.message.content.startswith("{")


def test_guided_choice_regex_and_vllm_fields(client):
    choices = ["positive", "negative", "neutral"]
    for seed in SEEDS:
        got = _chat(client, seed=seed, temperature=1.0, extra_body={"guided_choice": choices})
        assert got.choices[0].message.content in choices
        got = _chat(client, seed=seed, temperature=1.0,
                    extra_body={"guided_regex": r"[0-9]{3}-[a-z]{2,4}"})
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", got.choices[0].message.content)
        got = _chat(client, seed=seed, temperature=1.0,
                    extra_body={"structured_outputs": {"choice": ["x", "y"]}})
        assert got.choices[0].message.content in ("x", "y")
        got = client.completions.create(model=MODEL, prompt="n=", max_tokens=20, seed=seed,
                                        extra_body={"guided_regex": "(yes|no)!"})
        assert got.choices[0].text in ("yes!", "no!")
        got = _chat(client, seed=seed, temperature=1.0,
                    extra_body={"guided_json": person_schema()})
        Person.model_validate_json(got.choices[0].message.content)
        got = _chat(client, seed=seed, extra_body={"guided_grammar": 'start: "ab" | "cd"'})
        assert got.choices[0].message.content in ("ab", "cd")


def test_responses_text_format(client):
    out = client.responses.create(
        model=MODEL, input="a person", max_output_tokens=200,
        text={"format": {"type": "json_schema", "name": "person", "schema": person_schema(),
                         "strict": True}})
    Person.model_validate_json(out.output_text)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "bogus"}}}}, "response_format.json_schema.schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    # #41: these compile but overflowed llguidance at the first token: a 500, or 200 and then
    # an error event when streaming
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "a{1000000}"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"jsonn": {}}}, "structured_outputs.jsonn"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"guided_regex": "a", "enable_thinking": True}, "enable_thinking"),
    ({"guided_regex": "a", "reasoning_effort": "low"}, "reasoning_effort"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"guided_regex": "a+", "min_tokens": 3}, "min_tokens"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
])
def test_bad_specs_name_their_field(server, body, param):
    r = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    assert "<state>" not in r.text and "Parser:" not in r.text  # llguidance's internals


# Tool choice: the Qwen3.5/3.6 template (tools rendered), a model that never calls on its own.
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1,
                                                  "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {
        "name": "noop", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tool_server():
    # The scripted model answers text; under a mask it takes allowed tokens (the FakeProgram
    # rule), so every call below comes from the grammar.
    with served(scripted_engine(lambda prompt: "I will not call anything.",
                                max_seq_len=4096)) as s:
        yield s


def test_tool_choice_required_and_named(tool_server):
    with openai.OpenAI(base_url=f"{tool_server.url}/v1", api_key="x", max_retries=0,
                       timeout=30) as c:
        for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
            out = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "weather?"}], tools=TOOLS,
                tool_choice=choice, max_tokens=300)
            got = out.choices[0]
            assert got.finish_reason == "tool_calls", got
            assert got.message.tool_calls, got
            for call in got.message.tool_calls:
                assert call.function.name in ("get_weather", "noop")
                if call.function.name == "get_weather":
                    args = json.loads(call.function.arguments)
                    assert args["city"] in ("Paris", "Oslo") and 1 <= args["days"] <= 7
            if isinstance(choice, dict):
                assert [t.function.name for t in got.message.tool_calls] == ["get_weather"]
        r = httpx.post(f"{tool_server.url}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
            "tool_choice": "required", "enable_thinking": True}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "enable_thinking"


def test_anthropic_tool_choice_any_and_tool(tool_server):
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    with anthropic.Anthropic(base_url=tool_server.url, api_key="x", max_retries=0,
                             timeout=30) as c:
        for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
            msg = c.messages.create(model=MODEL, max_tokens=300, tools=tools, tool_choice=choice,
                                    messages=[{"role": "user", "content": "weather?"}])
            assert msg.stop_reason == "tool_use", msg
            uses = [b for b in msg.content if b.type == "tool_use"]
            assert uses, msg
            if choice["type"] == "tool":
                assert [u.name for u in uses] == ["get_weather"]
                assert uses[0].input["city"] in ("Paris", "Oslo")
