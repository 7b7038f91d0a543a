"""Hypothesis-generated bad bodies (wrong types, missing fields, huge numbers, NaN, lone
surrogates, invalid UTF-8, raw bytes, oversize) never get a 5xx, always get the API's error
schema, and never disturb a good request running alongside."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.gateway.conftest import MODEL, assert_fully_free, make_engine, served

MAX_BODY = 64 << 10
BASES = {
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                             "max_tokens": 4},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 4},
    "/v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 4},
}
KEYS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature",
        "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "seed", "stop", "stop_sequences", "n", "stream", "stream_options",
        "user", "enable_thinking", "chat_template_kwargs", "system", "thinking", "metadata",
        "echo", "logprobs", "best_of", "response_format", "tools", "logit_bias",
        "max_thinking_tokens"]

scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70)
           | st.sampled_from([0, 1, -1, 2**31, 2**63, 10**30, 7, 512, 10_000])
           | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=12) | st.sampled_from(["\ud800", "user", "text", "enabled", ""]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.sampled_from(["role", "content", "type", "text",
                                                         "include_usage", "enable_thinking",
                                                         "user_id", "budget_tokens", "x"]), inner, max_size=3),
                      max_leaves=10)


@st.composite
def mutated(draw) -> tuple[str, bytes]:
    path = draw(st.sampled_from(sorted(BASES)))
    body = dict(BASES[path])
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=4, unique=True)):
        if draw(st.booleans()) and key in body:
            del body[key]
        else:
            body[key] = draw(values)
    return path, json.dumps(body).encode()


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.binary(max_size=60).map(lambda b: b'{"messages": "' + b + b'"}'),
    st.integers(10, 6000).map(lambda n: b'{"max_tokens": 1' + b"0" * n + b"}"),
    st.integers(1, 4000).map(lambda n: b"[" * n + b"]" * n),
    st.just(b'{"prompt": "' + b"x" * (MAX_BODY + 10) + b'"}'),
    st.just(b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}'),
)


@pytest.fixture(scope="module")
def fuzz_server():
    """A server with a good streaming request repeating alongside the whole module."""
    engine = make_engine(max_queue=256)
    with served(engine, max_body_bytes=MAX_BODY) as s, httpx.Client(timeout=30) as fuzz_client:
        stop, outcomes = threading.Event(), []

        def good() -> None:
            with httpx.Client(timeout=30) as client:
                for _ in range(10_000):
                    if stop.is_set():
                        return
                    r = client.post(f"{s.url}/v1/chat/completions", json={
                        **BASES["/v1/chat/completions"], "max_tokens": 16, "stream": True})
                    whole = r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
                    outcomes.append(whole and '"finish_reason": "' in r.text)

        thread = threading.Thread(target=good, daemon=True)
        thread.start()
        yield s, fuzz_client
        stop.set()
        thread.join(30)
        assert outcomes and all(outcomes), f"{outcomes.count(False)} of {len(outcomes)} bad"
        assert_fully_free(engine)


def _check(fuzz_server, path: str, content: bytes) -> None:
    server, client = fuzz_server
    r = client.post(f"{server.url}{path}", content=content,
                    headers={"content-type": "application/json"})
    assert r.status_code < 500, (r.status_code, r.text[:300], content[:300])
    if r.status_code >= 400:
        err = r.json()
        if path == "/v1/messages":
            assert err["type"] == "error" and err["error"]["message"]
        else:
            assert err["error"]["message"] and err["error"]["type"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize=True)
@given(case=mutated())
def test_mutated_bodies(fuzz_server, case):
    _check(fuzz_server, *case)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize=True)
@given(path=st.sampled_from(sorted(BASES)), content=raw_bodies)
def test_raw_bodies(fuzz_server, path, content):
    _check(fuzz_server, path, content)
