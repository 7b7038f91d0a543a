"""Log-probs, n and batches of prompts through the official `openai` client over the FakeProgram,
whose log-probs are hand-computable (`fake_logprobs`: the produced token at 1/2, token + i at
2^-(i + 1)): every token's entry, its alternatives, streamed and not; n samples share their
prompt's prefill (each reuses all but its last token: cached_tokens) and are indexed as OpenAI
does, also across a batch of prompts; refusals name the field."""

from __future__ import annotations

import math

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from ninfer_jax.sampling_params import SamplingParams
from ninfer_jax.testing.fake_program import fake_logprobs
from tests.gateway.conftest import MODEL, TOKENIZER, assert_fully_free, make_engine, served
from tests.gateway.test_openai_client import strict, strict_completion_chunk

MESSAGES = [{"role": "user", "content": "tell me"}]


@pytest.fixture(scope="module")
def live():
    engine = make_engine(max_seq_len=256)
    with served(engine) as s, openai.OpenAI(base_url=f"{s.url}/v1", api_key="x",
                                            max_retries=0, timeout=30) as client:
        yield engine, client
        assert_fully_free(engine)


def _text(token_id: int) -> str:
    return TOKENIZER.token_bytes(token_id).decode("utf-8", errors="replace")


def test_chat_logprobs(live):
    engine, client = live
    resp = strict(ChatCompletion, client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, seed=3, logprobs=True, top_logprobs=3))
    want = engine.generate(messages=MESSAGES, sampling=SamplingParams(max_new_tokens=8, seed=3))
    content = resp.choices[0].logprobs.content
    assert [bytes(c.bytes) for c in content] == [TOKENIZER.token_bytes(t)
                                                 for t in want.token_ids]
    for entry, token in zip(content, want.token_ids):
        logprob, top = fake_logprobs(token, TOKENIZER.vocab_size)
        assert entry.logprob == pytest.approx(logprob)
        assert [(t.token, t.logprob) for t in entry.top_logprobs] == [
            (_text(i), pytest.approx(v)) for i, v in top[:3]]
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
    assert plain.choices[0].logprobs is None
    zero = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                          logprobs=True)
    assert all(c.top_logprobs == [] for c in zero.choices[0].logprobs.content)


def test_chat_logprobs_streamed(live):
    engine, client = live
    chunks = [strict(ChatCompletionChunk, c) for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=10, seed=5, logprobs=True, top_logprobs=2,
        stream=True)]
    want = engine.generate(messages=MESSAGES, sampling=SamplingParams(max_new_tokens=10, seed=5))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]
    assert [bytes(e.bytes) for e in entries] == [TOKENIZER.token_bytes(t)
                                                 for t in want.token_ids]
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_completion_logprobs(live):
    engine, client = live
    resp = strict(Completion, client.completions.create(
        model=MODEL, prompt="abc", max_tokens=6, seed=1, logprobs=2))
    want = engine.generate(prompt="abc", sampling=SamplingParams(max_new_tokens=6, seed=1))
    got = resp.choices[0].logprobs
    assert got.tokens == [_text(t) for t in want.token_ids]
    assert got.token_logprobs == pytest.approx([-math.log(2)] * len(want.token_ids))
    assert got.top_logprobs[0] == {_text(want.token_ids[0]): pytest.approx(-math.log(2)),
                                   _text((want.token_ids[0] + 1) % TOKENIZER.vocab_size):
                                       pytest.approx(-2 * math.log(2))}
    offsets = [0]
    for token in got.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert got.text_offset == offsets
    chunks = [strict_completion_chunk(c) for c in client.completions.create(
        model=MODEL, prompt="abc", max_tokens=6, seed=1, logprobs=2, stream=True)]
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == got.tokens
    echo = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, seed=1, echo=True)
    assert echo.choices[0].text.startswith("abc")


def test_n_shares_the_prefill_and_indexes_choices(live):
    engine, client = live
    prompt = "a prompt long enough to be worth sharing"
    n_prompt = len(TOKENIZER.encode(prompt))
    before = engine.stats().prefix.hits
    resp = strict(Completion, client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, n=4, seed=10, temperature=1.0,
        extra_body={"ignore_eos": True}))
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for j, choice in enumerate(resp.choices):  # sample j uses seed + j
        want = engine.generate(prompt=prompt, sampling=SamplingParams(
            max_new_tokens=6, seed=10 + j, ignore_eos=True))
        assert choice.text == want.text
    assert len({c.text for c in resp.choices}) > 1
    assert resp.usage.prompt_tokens == n_prompt  # counted once
    assert resp.usage.completion_tokens == 24
    assert resp.usage.prompt_tokens_details.cached_tokens == n_prompt - 1
    assert engine.stats().prefix.hits - before >= 4
    chat = strict(ChatCompletion, client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, n=3, seed=2))
    assert [c.index for c in chat.choices] == [0, 1, 2]


def test_batch_of_prompts_with_n(live):
    engine, client = live
    prompts = ["first prompt", [102, 103, 104, 105], "third"]
    resp = strict(Completion, client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, n=2, seed=4))
    assert [c.index for c in resp.choices] == list(range(6))
    for i, p in enumerate(prompts):
        for j in range(2):
            kw = {"prompt": p} if isinstance(p, str) else {"prompt_token_ids": p}
            want = engine.generate(**kw, sampling=SamplingParams(max_new_tokens=5, seed=4 + j))
            assert resp.choices[i * 2 + j].text == want.text
    assert resp.usage.prompt_tokens == sum(len(TOKENIZER.encode(p)) if isinstance(p, str)
                                           else len(p) for p in prompts)
    chunks = [strict_completion_chunk(c) for c in client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, n=2, seed=4, stream=True)]
    texts = [""] * 6
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [c.text for c in resp.choices]
    finishes = [c.choices[0].index for c in chunks if c.choices[0].finish_reason]
    assert sorted(finishes) == list(range(6))


@pytest.mark.parametrize("kwargs, param", [
    ({"prompt": ["ok", 5]}, "prompt[1]"),
    ({"prompt": [], }, "prompt"),
    ({"prompt": ["a"] * 9, "n": 2}, "prompt"),
    ({"prompt": "a", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "a", "logprobs": 2, "echo": True}, "echo"),  # no scoring path over the fake
])
def test_refusals(live, kwargs, param):
    _, client = live
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, max_tokens=2, **kwargs)
    assert e.value.body["param"] == param, e.value.body
