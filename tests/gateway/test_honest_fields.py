"""Every request field is honoured or refused: vLLM's output extensions (min_tokens, ignore_eos,
stop_token_ids, skip_special_tokens) change the answer as they say, compared with the Engine's
own result over the FakeProgram; unknown fields are a 400 naming them; streamed usage is
continuous when asked; the context-overflow error uses the wording client libraries match;
every response carries x-request-id; CORS answers only when allowed origins are set."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from ninfer_jax.sampling_params import SamplingParams
from tests.gateway.conftest import EOS, MODEL, TOKENIZER, make_engine, served

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def live():
    engine = make_engine()
    with served(engine) as s, httpx.Client(base_url=s.url, timeout=30) as http:
        yield engine, http


def _early_eos_prompt(engine, budget: int = 40) -> tuple[str, int]:
    """A prompt and seed whose fake answer ends with EOS well before `budget` tokens."""
    for seed in range(400):
        r = engine.generate(prompt=f"p{seed}", sampling=SamplingParams(max_new_tokens=budget,
                                                                       seed=seed))
        if r.finish_reason.value == "stop" and 2 <= r.usage.completion_tokens < budget // 2:
            return f"p{seed}", seed
    raise AssertionError("no prompt ends early")


def test_min_tokens_and_ignore_eos(live):
    engine, http = live
    prompt, seed = _early_eos_prompt(engine)
    base = engine.generate(prompt=prompt, sampling=SamplingParams(max_new_tokens=40, seed=seed))
    n = base.usage.completion_tokens
    assert base.token_ids[-1] == EOS
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "seed": seed}
    r = http.post("/v1/completions", json={**body, "min_tokens": n + 5}).json()
    assert r["usage"]["completion_tokens"] >= n + 5
    assert r["choices"][0]["text"].startswith(base.text)  # the same until the banned EOS
    r = http.post("/v1/completions", json={**body, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 40 and r["choices"][0]["finish_reason"] == "length"
    r = http.post("/v1/completions", json={**body, "ignore_eos": True,
                                           "skip_special_tokens": False}).json()
    assert "<|im_end|>" in r["choices"][0]["text"]  # EOS sampled and rendered, not ending it
    r = http.post("/v1/completions", json={**body, "ignore_eos": True}).json()
    assert "<|im_end|>" not in r["choices"][0]["text"]  # skip_special_tokens is the default


def test_stop_token_ids(live):
    _, http = live
    body = {"model": MODEL, "prompt": "stop ids", "max_tokens": 30, "seed": 4,
            "ignore_eos": True}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert len(full) >= 10
    stop_char = full[5]
    r = http.post("/v1/completions", json={**body, "stop_token_ids": [TOKENIZER.encode(stop_char)[0]]}).json()
    assert r["choices"][0]["text"] == full[: full.index(stop_char)]
    assert r["choices"][0]["finish_reason"] == "stop"
    bad = http.post("/v1/completions", json={**body, "stop_token_ids": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_token_ids"
    bad = http.post("/v1/completions", json={**body, "stop_token_ids": list(range(17))})
    assert bad.status_code == 400 and "at most 16" in bad.json()["error"]["message"]


@pytest.mark.parametrize("path, body, field", [
    ("/v1/chat/completions", CHAT, "prediction"),
    ("/v1/chat/completions", CHAT, "not_a_field"),
    ("/v1/completions", {"model": MODEL, "prompt": "x"}, "messages"),
    ("/v1/messages", {**CHAT, "max_tokens": 3}, "top_logprobs"),
])
def test_unknown_fields_are_refused(live, path, body, field):
    _, http = live
    r = http.post(path, json={**body, field: 1})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["message"].startswith(field)
    if path != "/v1/messages":
        assert err["param"] == field and err["code"] == "unsupported_parameter"


def test_harmless_fields_are_accepted(live):
    _, http = live
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "store": False,
                                                "metadata": {"a": "b"}, "service_tier": "auto",
                                                "user": "u"})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2, "store": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "store"


def test_continuous_usage_stats(live):
    _, http = live
    body = {**CHAT, "max_tokens": 12, "seed": 2, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    usages = [c["usage"] for c in chunks]
    assert all(u is not None for u in usages)
    done = [u["completion_tokens"] for u in usages]
    assert done == sorted(done) and done[-1] == 12 and done[0] == 0
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    r = http.post("/v1/chat/completions", json={
        **CHAT, "stream_options": {"continuous_usage_stats": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_context_overflow_wording(live):
    """OpenAI's message (litellm's ContextWindowExceededError matches it) and Anthropic's."""
    _, http = live
    long = "x" * 600  # 600 byte tokens > max_seq_len 512
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": long})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert err["message"] == ("This model's maximum context length is 512 tokens. However, your "
                              "prompt resulted in 600 tokens. Please reduce the length of the "
                              "prompt.")
    r = http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 500})
    err = r.json()["error"]
    n = int(err["message"].split("(")[1].split(" ")[0])
    assert err["message"] == (f"This model's maximum context length is 512 tokens. However, you "
                              f"requested {n + 500} tokens ({n} in the messages, 500 in the "
                              f"completion). Please reduce the length of the messages or "
                              f"max_tokens.")
    assert err["param"] == "max_tokens"
    r = http.post("/v1/messages", json={**CHAT, "max_tokens": 500})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("input length and `max_tokens` exceed "
                                                    "context limit: ")
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 5,
                                        "messages": [{"role": "user", "content": long}]})
    assert r.json()["error"]["message"].startswith("prompt is too long: ")


def test_openai_client_sees_context_error(live):
    _, http = live
    url = f"{str(http.base_url).rstrip('/')}/v1"
    with openai.OpenAI(base_url=url, api_key="x", max_retries=0) as client, \
            pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="y" * 600, max_tokens=1)
    assert e.value.code == "context_length_exceeded"
    assert "maximum context length is 512 tokens" in e.value.message


def test_request_id_on_every_response(live):
    _, http = live
    for method, path, body in [("GET", "/health", None), ("GET", "/nope", None),
                               ("POST", "/v1/chat/completions", {**CHAT, "max_tokens": 1}),
                               ("POST", "/v1/chat/completions", {"model": MODEL}),
                               ("POST", "/v1/messages", {**CHAT, "max_tokens": 1})]:
        r = http.request(method, path, json=body, headers={"x-request-id": "abc-123"})
        assert r.headers["x-request-id"] == "abc-123", (path, r.headers)
        fresh = http.request(method, path, json=body)
        assert len(fresh.headers["x-request-id"]) == 32
    weird = http.get("/health", headers={"x-request-id": "a b\tc"})
    assert weird.headers["x-request-id"] != "a b\tc"
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True,
                                                           "max_tokens": 2},
                     headers={"x-request-id": "s1"}) as r:
        assert r.headers["x-request-id"] == "s1"


def test_cors_only_with_allowed_origins():
    origin = {"origin": "https://app.example", "access-control-request-method": "POST"}
    with served(make_engine()) as s:
        r = httpx.options(f"{s.url}/v1/chat/completions", headers=origin)
        assert "access-control-allow-origin" not in r.headers
    with served(make_engine(), allowed_origins=["https://app.example"]) as s:
        r = httpx.options(f"{s.url}/v1/chat/completions", headers=origin)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.post(f"{s.url}/v1/chat/completions", json={**CHAT, "max_tokens": 1},
                       headers={"origin": "https://app.example"})
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "x-request-id" in r.headers["access-control-expose-headers"]
        other = httpx.options(f"{s.url}/v1/chat/completions",
                              headers={**origin, "origin": "https://evil.example"})
        assert other.headers.get("access-control-allow-origin") != "https://evil.example"
    from ninfer_jax.errors import ConfigError
    from ninfer_jax.gateway.server import check_origins
    with pytest.raises(ConfigError):
        check_origins(["https://a.example/"])
