"""The newer endpoints and fields with the real clients against a live server: the Responses API
(`openai` `responses.create`, plain and streamed, in the API's event order), Anthropic
`count_tokens` (the anthropic SDK) equal to the usage of the same request, `/tokenize` and
`/detokenize` round trips, `n` over a list of prompts (each prompt prefilled once), and `echo`
with log-probs on completions equal to the in-process Scorer's values for the same tokens.

The Engine is the (thinking) FakeProgram over a ByteTokenizer sized to the dense fixture model's
vocabulary, so the prompt scorer behind `echo` is the real CausalScoring core of that model."""

from __future__ import annotations

import functools
import itertools
import json
import math

import anthropic
import httpx
import numpy as np
import openai
import pytest
from openai.types import Completion

from ninfer_jax.api import Engine
from ninfer_jax.engine import EngineCore, EngineCoreConfig
from ninfer_jax.frontend import Frontend
from ninfer_jax.gateway.http.logprobs import MAX_LOGPROBS, PromptScorer
from ninfer_jax.program.limits import ProgramLimits
from ninfer_jax.sampling_params import SamplingParams
from ninfer_jax.scoring import CausalScoreCore, Scorer, ScoringConfig
from ninfer_jax.testing import ByteTokenizer
from tests.gateway.conftest import CHATML, MODEL, PAGE_SIZE, ThinkingFakeProgram, served
from tests.gateway.test_openai_client import strict
from tests.models.conftest import loaded

VOCAB = 384  # the dense fixture's vocabulary
TOKENIZER = ByteTokenizer(VOCAB)
FRONTEND = Frontend(TOKENIZER, CHATML)
EOS = TOKENIZER.special_id("<|im_end|>")


@functools.cache
def _scorer() -> Scorer:
    m = loaded("dense")
    core = CausalScoreCore(m.config, m.params, ScoringConfig(
        max_len=64, min_len=64, max_batch_tokens=64, top_logprobs=MAX_LOGPROBS))
    return Scorer(core, TOKENIZER)


def _engine(max_seq_len: int = 256) -> Engine:
    limits = ProgramLimits(
        max_seq_len=max_seq_len, page_size=PAGE_SIZE, total_pages=4 * (max_seq_len // PAGE_SIZE),
        total_slots=4, max_concurrency=4, prefill_chunk=64, vocab_size=VOCAB,
        total_checkpoint_slots=8)
    core = EngineCore(ThinkingFakeProgram(limits, eos_id=EOS), FRONTEND,
                      EngineCoreConfig(idle_wait_s=0.01))
    return Engine(core, FRONTEND, None)


@pytest.fixture(scope="module")
def live():
    engine = _engine()
    with served(engine, prompt_scorer=PromptScorer(scorer=_scorer())) as s:
        yield s, engine


@pytest.fixture(scope="module")
def oa(live):
    with openai.OpenAI(base_url=f"{live[0].url}/v1", api_key="x", max_retries=0,
                       timeout=60) as c:
        yield c


# --- Responses API -------------------------------------------------------------------------

def test_responses_plain_matches_the_engine(live, oa):
    _, engine = live
    r = oa.responses.create(model=MODEL, input="say something", instructions="be brief",
                            max_output_tokens=12, temperature=0.7,
                            extra_body={"seed": 3})
    want = engine.generate(messages=[{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": "say something"}],
                           sampling=SamplingParams(max_new_tokens=12, temperature=0.7, seed=3),
                           enable_thinking=False)
    assert r.object == "response" and r.model == MODEL
    assert [o.type for o in r.output] == ["message"]
    assert r.output_text == want.text
    assert r.status == ("completed" if want.finish_reason.value == "stop" else "incomplete")
    assert r.usage.input_tokens == want.usage.prompt_tokens
    assert r.usage.output_tokens == want.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_responses_content_parts_read_as_their_joined_text(live):
    """`input` items whose content (or a tool output) is a list of text parts read as the
    joined text; any other part is refused, naming it."""
    server, _ = live
    body = {"model": MODEL, "max_output_tokens": 6, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        whole = c.post("/v1/responses", json={**body, "input": "say something"})
        parts = c.post("/v1/responses", json={**body, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "say "},
            {"type": "input_text", "text": "something"}]}]})
        assert whole.status_code == parts.status_code == 200
        text = [r.json()["output"][0]["content"][0]["text"] for r in (whole, parts)]
        assert text[0] == text[1] and parts.json()["usage"] == whole.json()["usage"]
        bad = c.post("/v1/responses", json={**body, "input": [{"role": "user", "content": [
            {"type": "input_text", "text": "look"}, {"type": "input_image", "image_url": "x"}]}]})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "input[0].content[1].type"


def _collapse(kinds: list[str]) -> list[str]:
    return [k for k, _ in itertools.groupby(kinds)]


def _stopping_seed(engine: Engine, text: str, thinking: bool, budget: int = 200) -> int:
    """The first seed whose answer to `text` ends (EOS) within `budget` tokens: the SDK's
    stream helper only accepts a `response.completed` end (a budget-cut answer is
    `response.incomplete`, tested on the raw stream)."""
    for seed in range(100):
        r = engine.generate(messages=[{"role": "user", "content": text}], enable_thinking=thinking,
                            sampling=SamplingParams(max_new_tokens=budget, seed=seed))
        if r.finish_reason.value == "stop":
            return seed
    raise AssertionError("no seed ends within the budget")


MESSAGE_EVENTS = [
    "response.output_item.added", "response.content_part.added", "response.output_text.delta",
    "response.output_text.done", "response.content_part.done", "response.output_item.done"]


def test_responses_streamed_event_order(live, oa):
    _, engine = live
    seed = _stopping_seed(engine, "stream it", thinking=False)
    with oa.responses.stream(model=MODEL, input="stream it", max_output_tokens=200,
                             extra_body={"seed": seed}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert _collapse(kinds) == ["response.created", "response.in_progress", *MESSAGE_EVENTS,
                                "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    want = engine.generate(messages=[{"role": "user", "content": "stream it"}],
                           sampling=SamplingParams(max_new_tokens=200, seed=seed),
                           enable_thinking=False)
    assert text == want.text == final.output_text and final.status == "completed"
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == text
    assert events[-1].response.usage.output_tokens == want.usage.completion_tokens
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_responses_streamed_cut_by_max_output_tokens_is_incomplete(live, oa):
    events = list(oa.responses.create(model=MODEL, input="a long one", max_output_tokens=3,
                                      stream=True, extra_body={"seed": 1}))
    assert _collapse([e.type for e in events]) == [
        "response.created", "response.in_progress", *MESSAGE_EVENTS, "response.incomplete"]
    last = events[-1].response
    assert last.status == "incomplete"
    assert last.incomplete_details.reason == "max_output_tokens"
    assert last.usage.output_tokens == 3


def test_responses_streamed_with_reasoning(live, oa):
    """With reasoning on, the reasoning item comes first, closed before the message opens."""
    _, engine = live
    seed = _stopping_seed(engine, "think first", thinking=True)
    with oa.responses.stream(model=MODEL, input="think first", max_output_tokens=200,
                             reasoning={"effort": "high"}, extra_body={"seed": seed}) as stream:
        kinds = _collapse([e.type for e in stream])
        final = stream.get_final_response()
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.output_item.done", *MESSAGE_EVENTS, "response.completed"]
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.usage.output_tokens_details.reasoning_tokens == 3  # the thought; not </think>


# --- Anthropic count_tokens ----------------------------------------------------------------

def test_anthropic_count_tokens_equals_the_usage(live):
    server, _ = live
    messages = [{"role": "user", "content": "a question never asked before"},
                {"role": "assistant", "content": "an answer"},
                {"role": "user", "content": [{"type": "text", "text": "and a follow-up"}]}]
    with anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0,
                             timeout=30) as an:
        for extra in ({}, {"thinking": {"type": "enabled", "budget_tokens": 16}}):
            kw = {"system": "be brief", "messages": messages, **extra}
            count = an.messages.count_tokens(model=MODEL, **kw).input_tokens
            msg = an.messages.create(model=MODEL, max_tokens=32, **kw)
            used = msg.usage.input_tokens + (msg.usage.cache_read_input_tokens or 0)
            assert count == used > 0
            assert count == len(FRONTEND.prepare(
                messages=[{"role": "system", "content": "be brief"}, messages[0], messages[1],
                          {"role": "user", "content": "and a follow-up"}],
                enable_thinking=bool(extra)).token_ids)
        with pytest.raises(anthropic.BadRequestError) as e:
            an.messages.count_tokens(model=MODEL, messages=[])
        assert "messages" in str(e.value)


# --- /tokenize and /detokenize -------------------------------------------------------------

def test_tokenize_detokenize_round_trip(live):
    server, _ = live
    text = "héllo wörld <|im_end|> ✓"
    with httpx.Client(base_url=server.url, timeout=30) as c:
        tok = c.post("/tokenize", json={"model": MODEL, "prompt": text,
                                        "return_token_strs": True}).json()
        assert tok["tokens"] == list(FRONTEND.prepare(prompt=text).token_ids)
        assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
        assert len(tok["token_strs"]) == tok["count"]
        assert c.post("/detokenize", json={"model": MODEL, "tokens": tok["tokens"]}
                      ).json() == {"prompt": text}
        chat = c.post("/tokenize", json={"model": MODEL, "messages": [
            {"role": "user", "content": "hi"}]}).json()
        assert TOKENIZER.decode(chat["tokens"]) == "<|im_start|>user\nhi<|im_end|>\n" \
                                                   "<|im_start|>assistant\n"
        assert c.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"] == \
            TOKENIZER.decode(chat["tokens"])
        bad = c.post("/detokenize", json={"tokens": [1, VOCAB]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens[1]"


# --- n over a list of prompts --------------------------------------------------------------

def test_n_over_a_list_of_prompts_prefills_each_prompt_once(live, oa):
    _, engine = live
    prompts = ["the first prompt of a batch", "the second prompt, a longer one"]
    lens = [len(TOKENIZER.encode(p)) for p in prompts]
    before = engine.stats().prefix.hits
    resp = strict(Completion, oa.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, n=3, seed=20, temperature=1.0,
        extra_body={"ignore_eos": True}))
    assert [c.index for c in resp.choices] == list(range(6))
    for i, p in enumerate(prompts):
        for j in range(3):
            want = engine.generate(prompt=p, sampling=SamplingParams(
                max_new_tokens=5, seed=20 + j, ignore_eos=True))
            assert resp.choices[3 * i + j].text == want.text
    assert resp.usage.prompt_tokens == sum(lens)  # each prompt counted once
    assert resp.usage.completion_tokens == 30
    # every sample reuses its prompt's prefill but the last token (which it feeds itself)
    assert resp.usage.prompt_tokens_details.cached_tokens == sum(n - 1 for n in lens)
    assert engine.stats().prefix.hits - before >= 6


# --- echo with log-probs -------------------------------------------------------------------

def _scored(text: str, n: int) -> tuple[list[int], np.ndarray, list[dict[int, float]]]:
    """The in-process Scorer's log-probs of `text`'s tokens after the first, and the top-n."""
    scorer = _scorer()
    ids = TOKENIZER.encode(text)
    [result] = scorer.score(token_ids=[ids])
    [raw] = scorer.core.score([scorer.request(token_ids=ids)], roll=True)
    tops = [dict(zip(t[:n].tolist(), v[:n].tolist()))
            for t, v in zip(raw.top_ids, raw.top_logprobs)]
    return ids, result.token_logprobs, tops


def _decode(token_id: int) -> str:
    return TOKENIZER.token_bytes(token_id).decode("utf-8", errors="replace")


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_echo_logprobs_equal_the_scorer(live, oa, max_tokens):
    text = "Once upon a time there was a model."
    ids, want, tops = _scored(text, 3)
    # not re-validated: the client types token_logprobs as floats, but the first prompt
    # token has none (null, as OpenAI's legacy completions answer)
    resp = oa.completions.create(model=MODEL, prompt=text, max_tokens=max_tokens, echo=True,
                                 logprobs=3, seed=1)
    lp = resp.choices[0].logprobs
    assert resp.choices[0].text.startswith(text)
    assert lp.tokens[:len(ids)] == [_decode(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:len(ids)], want, rtol=0, atol=1e-5)
    for got, top in zip(lp.top_logprobs[1:len(ids)], tops):
        names = [_decode(t) for t in top]
        assert got.keys() == set(names)
        for t, v in top.items():  # ids whose text is not unique (bytes >= 0x80) share a key
            if names.count(_decode(t)) == 1:
                assert got[_decode(t)] == pytest.approx(v, abs=1e-5)
    generated = lp.token_logprobs[len(ids):]
    assert len(generated) == max_tokens  # the FakeProgram's tokens: each at log 1/2
    assert generated == pytest.approx([-math.log(2)] * max_tokens)
    assert lp.text_offset[:2] == [0, len(_decode(ids[0]))]
    assert resp.usage.prompt_tokens == len(ids)


# --- exact repeats -------------------------------------------------------------------------

def test_an_exact_repeat_reuses_the_prompt_but_its_last_chunk(live, oa):
    """A retry or a regenerate sends the same prompt again: its second send reuses the whole
    prompt but its last prefill chunk (the one it would run anyway to sample its first token),
    on chat, completions and Responses alike, and answers the same."""
    chunk = 64  # the live Engine's prefill_chunk

    def reused(prompt_tokens: int) -> int:  # where the prompt's last chunk starts
        return (prompt_tokens - 1) // chunk * chunk

    question = "why do foxes and crows argue? " * 4
    sends = {
        "chat": lambda: oa.chat.completions.create(
            model=MODEL, messages=[{"role": "system", "content": "answer briefly"},
                                   {"role": "user", "content": question}],
            max_tokens=4, temperature=0),
        "completions": lambda: oa.completions.create(
            model=MODEL, prompt="a raw prompt " + question, max_tokens=4, temperature=0),
    }
    for name, send in sends.items():
        first, second = send(), send()
        n = first.usage.prompt_tokens
        assert n > chunk and first.usage.prompt_tokens_details.cached_tokens == 0, name
        assert second.usage.prompt_tokens_details.cached_tokens == reused(n), name
        assert second.choices[0] == first.choices[0], name
    first, second = (oa.responses.create(model=MODEL, input="in Responses: " + question,
                                         max_output_tokens=4, temperature=0) for _ in range(2))
    n = first.usage.input_tokens
    assert n > chunk and first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens_details.cached_tokens == reused(n)
    assert second.output_text == first.output_text


def test_a_finished_stream_holds_no_capacity_before_its_last_chunk(live):
    """The capacity of a streamed request is back when its finishing chunk goes out, not after
    the stream closes: a sequential client near `max_queue` that sends again on `[DONE]` is
    never refused because of the request it just read."""
    server, engine = live
    # unseeded, so some of the five end on EOS ('stop') before their 3 tokens: any finish counts
    body = {"model": MODEL, "prompt": "one after another", "max_tokens": 3, "stream": True}
    for _ in range(5):
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                chunk = line.removeprefix("data: ")
                if chunk.startswith("{") and json.loads(chunk)["choices"][0]["finish_reason"]:
                    assert engine.outstanding == 0, line
                    break
            else:
                raise AssertionError("no finishing chunk")
