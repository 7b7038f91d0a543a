"""The official `openai` client against a live server: chat and completions, streaming and not.

Every answer is re-validated strictly with the client's own pydantic models, and its text is
checked against the Engine's own result for the same prompt and seed (the FakeProgram is
deterministic), so the gateway neither loses nor invents output.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from ninfer_jax.sampling_params import SamplingParams
from tests.gateway.conftest import MODEL, assert_fully_free, make_engine, served

MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello "},
                                         {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": "tell me more"}]
FLAT = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
         else "".join(p["text"] for p in m["content"])} for m in MESSAGES]


def strict(model, obj):
    """Re-validates a client object with its pydantic model (the client only constructs)."""
    return model.model_validate(obj.model_dump(mode="json", exclude_unset=True))


@pytest.fixture
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                       timeout=30) as c:
        yield c


def strict_completion_chunk(obj):
    """As `strict`; the client types a completion choice's finish_reason as never null, though
    the API streams null until the last chunk, so null is checked apart."""
    dump = obj.model_dump(mode="json", exclude_unset=True)
    for choice in dump["choices"]:
        if choice["finish_reason"] is None:
            choice["finish_reason"] = "stop"
    Completion.model_validate(dump)
    return obj


def expected(engine_of, server, **kw):
    engine = engine_of(server)
    return engine.generate(sampling=SamplingParams(**kw.pop("sampling")), **kw)


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_chat_matches_engine_result(client, server, engine_of):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=12, temperature=0.7, top_p=0.9,
        seed=7, presence_penalty=0.5, frequency_penalty=0.1,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    resp = strict(ChatCompletion, resp)
    want = expected(engine_of, server, messages=FLAT, sampling={
        "max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9, "seed": 7, "top_k": 20, "min_p": 0.05,
        "presence_penalty": 0.5, "frequency_penalty": 0.1, "repetition_penalty": 1.1})
    choice = resp.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == want.text
    assert choice.finish_reason == want.finish_reason.value
    assert resp.usage.prompt_tokens == want.usage.prompt_tokens
    assert resp.usage.completion_tokens == want.usage.completion_tokens
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    assert resp.model == MODEL and resp.object == "chat.completion"


def test_chat_stream_order_and_usage(client, server, engine_of):
    stream = client.chat.completions.create(
        model=MODEL, messages=FLAT, max_tokens=20, seed=3, stream=True,
        stream_options={"include_usage": True}, extra_body={"enable_thinking": True})
    chunks = [strict(ChatCompletionChunk, c) for c in stream]
    want = expected(engine_of, server, messages=FLAT, enable_thinking=True,
                    sampling={"max_new_tokens": 20, "seed": 3})
    assert chunks[0].choices[0].delta.role == "assistant"
    body, usage_chunk = chunks[:-1], chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == want.usage.completion_tokens
    # #41: chat usage carried no reasoning_tokens
    assert usage_chunk.usage.completion_tokens_details.reasoning_tokens == \
        want.usage.reasoning_tokens
    assert (want.usage.reasoning_tokens > 0) == bool(want.reasoning_text)
    assert all(c.usage is None for c in body)
    assert [c.choices[0].finish_reason for c in body].count(None) == len(body) - 1
    assert body[-1].choices[0].finish_reason == want.finish_reason.value
    deltas = [c.choices[0].delta for c in body]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (want.reasoning_text, want.text)
    if want.reasoning_text and want.text:  # reasoning deltas all come before content deltas
        kinds = ["r" if getattr(d, "reasoning_content", None) else "c" for d in deltas
                 if d.content or getattr(d, "reasoning_content", None)]
        assert kinds == sorted(kinds, reverse=True)


@pytest.mark.parametrize("how", ["flag", "chat_template_kwargs"])
def test_chat_thinking_split(client, how):
    extra = ({"enable_thinking": True} if how == "flag"
             else {"chat_template_kwargs": {"enable_thinking": True}})
    resp = None
    for seed in range(20):  # the fake model may end before closing the thought; bounded
        resp = client.chat.completions.create(model=MODEL, messages=FLAT, max_tokens=24,
                                              seed=seed, extra_body=extra)
        if resp.choices[0].message.content:
            break
    message = resp.choices[0].message
    assert len(message.reasoning_content) == 3  # the fake model closes </think> after 3 tokens
    assert message.content
    # the three thought tokens (</think> goes with the answer's first delta)
    assert resp.usage.completion_tokens_details.reasoning_tokens == 3
    plain = client.chat.completions.create(model=MODEL, messages=FLAT, max_tokens=8, seed=1)
    assert getattr(plain.choices[0].message, "reasoning_content", None) is None
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0


def test_chat_thinking_budget(client):
    """max_thinking_tokens (an extension field): the reasoning stops after that many sampled
    tokens and the answer goes on as content; bad values are refused naming the field."""
    extra = {"enable_thinking": True, "max_thinking_tokens": 1}
    resp = client.chat.completions.create(model=MODEL, messages=FLAT, max_tokens=12, seed=3,
                                          extra_body=extra)
    message = resp.choices[0].message
    assert len(message.reasoning_content.strip()) == 1 and message.content
    with pytest.raises(openai.BadRequestError, match="max_thinking_tokens"):
        client.chat.completions.create(model=MODEL, messages=FLAT, max_tokens=4, extra_body={
            "max_thinking_tokens": 0})


def test_completions(client, server, engine_of):
    resp = strict(Completion, client.completions.create(
        model=MODEL, prompt="once upon a time", max_tokens=10, seed=5, stop=["zz"]))
    want = expected(engine_of, server, prompt="once upon a time",
                    sampling={"max_new_tokens": 10, "seed": 5, "stop": ("zz",)})
    assert resp.choices[0].text == want.text
    assert resp.choices[0].finish_reason == want.finish_reason.value
    assert resp.usage.completion_tokens == want.usage.completion_tokens
    ids = client.completions.create(model=MODEL, prompt=[111, 110, 99, 101], max_tokens=4,
                                    seed=5)
    assert ids.usage.prompt_tokens == 4


def test_completions_stream(client, server, engine_of):
    chunks = [strict_completion_chunk(c) for c in client.completions.create(
        model=MODEL, prompt="abc", max_tokens=15, seed=9, stream=True,
        stream_options={"include_usage": True})]
    want = expected(engine_of, server, prompt="abc", sampling={"max_new_tokens": 15, "seed": 9})
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-2].choices[0].finish_reason == want.finish_reason.value
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens


def test_stop_string_is_not_emitted(client):
    base = client.completions.create(model=MODEL, prompt="xyz", max_tokens=30, seed=11,
                                     temperature=0)
    text = base.choices[0].text
    if len(text) < 6:
        pytest.skip("the fake model ended too early for this prompt")
    stop = text[3:5]
    cut = client.completions.create(model=MODEL, prompt="xyz", max_tokens=30, seed=11,
                                    temperature=0, stop=stop)
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("kwargs, param", [
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"seed": -3}, "seed"),
    ({"stop": [""]}, "stop[0]"),
    ({"logprobs": True, "top_logprobs": 21}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"extra_body": {"min_p": 2}}, "min_p"),
])
def test_bad_chat_fields_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=FLAT, **kwargs)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body
    if e.value.body["code"] == "context_length_exceeded":  # OpenAI's wording, which clients read
        assert e.value.body["message"].startswith("This model's maximum context length is 512 "
                                                  "tokens. However, you requested 1")
    else:
        assert e.value.body["message"].startswith(param)


@pytest.mark.parametrize("kwargs, param", [
    ({"echo": True, "logprobs": 1}, "echo"), ({"logprobs": 21}, "logprobs"),
    ({"best_of": 3}, "best_of"),
    ({"prompt": [999_999]}, "prompt[0]"), ({"prompt": "x" * 600}, "prompt"),
])
def test_bad_completion_fields(client, kwargs, param):
    kwargs.setdefault("prompt", "hi")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, max_tokens=4, **kwargs)
    assert e.value.body["param"] == param, e.value.body


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-7", messages=FLAT)
    assert e.value.body["code"] == "model_not_found"


def test_api_key():
    with served(make_engine(), api_key="s3cret") as s:
        for key in ("wrong", None):
            headers = {} if key is None else {"authorization": f"Bearer {key}"}
            r = httpx.post(f"{s.url}/v1/chat/completions", headers=headers,
                           json={"messages": FLAT, "max_tokens": 2})
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.get(f"{s.url}/v1/models").status_code == 401
        assert httpx.get(f"{s.url}/health").status_code == 200  # probes stay open
        with openai.OpenAI(base_url=f"{s.url}/v1", api_key="s3cret", max_retries=0) as c:
            assert c.chat.completions.create(model=MODEL, messages=FLAT, max_tokens=3).usage
        r = httpx.post(f"{s.url}/v1/messages", headers={"x-api-key": "s3cret"},
                       json={"messages": FLAT[1:2], "max_tokens": 3})
        assert r.status_code == 200, r.text


def test_session_key_is_accepted(client, server, engine_of):
    client.chat.completions.create(model=MODEL, messages=FLAT, max_tokens=3, user="alice")
    # #41: the SDK's prompt_cache_key was refused as unknown; it is the session key now
    client.chat.completions.create(model=MODEL, messages=FLAT, max_tokens=3,
                                   prompt_cache_key="conversation-7")
    client.completions.create(model=MODEL, prompt="hello", max_tokens=3,
                              extra_body={"prompt_cache_key": "conversation-7"})
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=FLAT, max_tokens=3,
                                       extra_body={"prompt_cache_key": 7})
    assert e.value.body["param"] == "prompt_cache_key"
    client.with_options(default_headers={"x-session-id": "s-1"}).chat.completions.create(
        model=MODEL, messages=FLAT, max_tokens=3)
    assert_fully_free(engine_of(server))


def test_prefix_reuse_reports_cached_tokens(client, server, engine_of):
    """A follow-up turn of the same session reuses the first turn's checkpoint."""
    history = [{"role": "user", "content": "remember the number seven, please"}]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=6,
                                           seed=2, user="reuse-test")
    history += [{"role": "assistant", "content": first.choices[0].message.content},
                {"role": "user", "content": "which number?"}]
    second = strict(ChatCompletion, client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=6, seed=2, user="reuse-test"))
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < second.usage.prompt_tokens
    assert first.usage.prompt_tokens <= cached
    metrics = httpx.get(f"{server.url}/metrics").text
    assert "ninfer_prefix_hits_total" in metrics and "ninfer_prefix_cached_tokens_total" in metrics
