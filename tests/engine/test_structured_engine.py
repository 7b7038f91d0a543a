"""Constrained decoding through the Engine on the embedded demo model (the real Program: the
mask applied on the device, prefill's first token included), sharing the compiled Programs of
`test_speculative_engine.py` (K = 0 and K = 2).

Hypothesis draws small JSON schemas (objects of bounded strings, bounded integers, booleans,
enums and arrays of them, nested one level, some properties optional); every answer, greedy or
sampled, with and without MTP speculation, in a batch shared with an unconstrained request,
ends with EOS and its text parses and validates against its schema. Rows without a grammar are
untouched (the unconstrained request's output equals its output alone), and grammar rows
propose one token per round (drafting is off for them). On the Program itself: the token a
mask allows is the one sampled at a prefill's last chunk, a forced-control step and a decode
round.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer_jax.engine import FinishReason
from ninfer_jax.program.errors import ResourceError
from ninfer_jax.program.pending import BatchKind
from ninfer_jax.sampling_params import SamplingParams, StructuredOutput
from tests.engine.test_speculative_engine import K, _ids, _opened, engine

NAMES = st.sampled_from(["id", "name", "ok", "size", "kind", "tags", "meta", "x"])
# Small enough that any answer fits the shared Programs' max_seq_len (72) after the prompt.
LEAF = st.one_of(
    st.integers(1, 4).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-50, 50), st.integers(0, 500)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}),
    st.just({"type": "boolean"}),
    st.lists(st.sampled_from(["red", "blue", "a b"]), min_size=1, max_size=3,
             unique=True).map(lambda v: {"enum": v}),
)
ITEMS = st.one_of(LEAF, LEAF.map(lambda leaf: {"type": "array", "items": leaf, "maxItems": 2}))


def _object(values):
    return st.dictionaries(NAMES, values, min_size=1, max_size=2).flatmap(
        lambda props: st.sets(st.sampled_from(sorted(props))).map(
            lambda required: {"type": "object", "properties": props,
                              "required": sorted(required), "additionalProperties": False}))


SCHEMAS = _object(st.one_of(ITEMS, _object(LEAF)))
PROMPT = {"prompt": "Once upon a time"}
OTHER = {"prompt": "Tom had a dog"}  # the unconstrained request's
PLAIN = SamplingParams(temperature=0.0, max_new_tokens=16)


def _plain_alone(k: int):
    with engine(k) as (e, _):
        return e.submit(**OTHER, sampling=PLAIN).result(120).token_ids


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck),
          derandomize=True)
@given(schema=SCHEMAS, temperature=st.sampled_from([0.0, 1.0]))
def test_schema_outputs_always_parse_and_validate(schema, temperature):
    spec = StructuredOutput("json_schema", json.dumps(schema))
    for k in (0, K):
        alone = _plain_alone(k)
        with engine(k) as (e, rows):
            plain = e.submit(**OTHER, sampling=PLAIN)
            handles = [e.submit(**PROMPT, sampling=SamplingParams(
                temperature=temperature, seed=seed, max_new_tokens=64, structured=spec))
                for seed in range(3)]
            for h in handles:
                r = h.result(120)
                assert r.finish_reason is FinishReason.STOP, (schema, r.text)
                jsonschema.validate(json.loads(r.text), schema)
            assert plain.result(120).token_ids == alone
        prompt = tuple(_ids(PROMPT["prompt"]))
        decode = [r for r in rows if r.kind is BatchKind.DECODE]
        assert all(r.produced == 1 for r in decode if r.tokens[: len(prompt)] == prompt)
        if k:  # the unconstrained row still speculates
            assert max(r.produced for r in decode if r.tokens[: len(prompt)] != prompt) > 1


def test_choice_and_regex_on_the_demo_model():
    with engine(K) as (e, _):
        for seed in range(3):
            got = e.submit(**PROMPT, sampling=SamplingParams(
                temperature=1.0, seed=seed, max_new_tokens=20,
                structured=StructuredOutput("choice", choices=("a red fox", "the blue sky"))))
            assert got.result(120).text in ("a red fox", "the blue sky")
            got = e.submit(**PROMPT, sampling=SamplingParams(
                temperature=1.0, seed=seed, max_new_tokens=20,
                structured=StructuredOutput("regex", r"[a-z]{2,5} [0-9]{1,3}")))
            text = got.result(120).text
            assert text.split(" ")[0].isalpha() and text.split(" ")[1].isdigit(), text


def _only(token: int, words: int) -> np.ndarray:
    mask = np.zeros(words, np.uint32)
    mask[token // 32] = np.uint32(1 << (token % 32))
    return mask


def test_program_masks_prefill_control_and_decode_tokens():
    """The real Program (K = 0 and K = 2) samples exactly the one token a mask allows at each
    kind of step, sampled or greedy; a masked decode row proposes one token; bad masks are
    refused before anything runs."""
    for k in (0, K):
        program = _opened(k)[0]
        words = program.limits.mask_words
        ids = _ids(PROMPT["prompt"])
        sampling = SamplingParams(temperature=1.0, seed=3, max_new_tokens=12)
        handle = program.materialize(program.plan_admission(len(ids), 12), ids, sampling)
        try:
            with pytest.raises(ResourceError):
                program.prefill(handle, mask=np.zeros(words, np.uint32))  # allows nothing
            with pytest.raises(ResourceError):
                program.prefill(handle, mask=np.ones(words + 1, np.uint32))
            batch = None
            while batch is None:
                batch = program.prefill(handle, mask=_only(777, words))
            assert batch.row_tokens(0) == [777]
            program.commit(batch, [1])
            batch = program.control(handle, [11, 12], mask=_only(901, words))
            assert batch.row_tokens(0) == [901]
            program.commit(batch, [1])
            for token in (5, 2048, 4095):
                batch = program.decode([handle], masks=[_only(token, words)])
                assert batch.row_tokens(0) == [token] and int(batch.produced[0]) == 1
                program.commit(batch, [1])
            assert program.tokens(handle)[len(ids):] == [777, 11, 12, 901, 5, 2048, 4095]
        finally:
            program.release(handle)


def _request_rows(rows, prompt: tuple[int, ...]) -> list:
    return [r for r in rows if r.tokens[: len(prompt)] == prompt]


@pytest.mark.parametrize("k", [0, K])
def test_text_the_grammar_forces_goes_in_as_forced_control(k):
    """Where the grammar allows one continuation only (a schema's keys and punctuation, a named
    tool's call prefix), the Engine commits it as forced control (its canonical tokens in one
    step, no sampling), then samples on under the mask; a request with stop strings samples
    every token (forced text is not matched against them)."""
    schema = {"type": "object", "properties": {"story": {"type": "string", "maxLength": 12},
                                               "n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["story", "n"], "additionalProperties": False}
    spec = StructuredOutput("json_schema", json.dumps(schema))
    prompt = tuple(_ids(PROMPT["prompt"]))
    with engine(k) as (e, rows):
        r = e.submit(**PROMPT, sampling=SamplingParams(temperature=0.0, max_new_tokens=48,
                                                       structured=spec)).result(120)
        assert r.finish_reason is FinishReason.STOP, r.text
        value = json.loads(r.text)
        jsonschema.validate(value, schema)
        mine = _request_rows(rows, prompt)
        control = [row for row in mine if row.kind is BatchKind.CONTROL]
        # `"story": "` after the sampled `{`, and `", "n": ` after the string closes
        assert len(control) >= 2, mine
        assert len(mine) < len(r.token_ids)  # fewer steps than tokens
        rows.clear()
        stopped = e.submit(**PROMPT, sampling=SamplingParams(
            temperature=0.0, max_new_tokens=48, structured=spec, stop=("qqq",))).result(120)
        jsonschema.validate(json.loads(stopped.text), schema)
        assert not [row for row in _request_rows(rows, prompt) if row.kind is BatchKind.CONTROL]


def test_a_named_tool_choice_forces_the_call_prefix():
    """tool_choice naming a function: the call's markup and name are forced control."""
    from ninfer_jax.frontend.tool_calls import call_grammar

    tools = [{"type": "function", "function": {
        "name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"]}}}]
    program, frontend, _ = _opened(0)
    grammar = call_grammar(tools, "get_weather", frontend.tokenizer.special_tokens)
    prompt = tuple(_ids(PROMPT["prompt"]))
    with engine(0) as (e, rows):
        r = e.submit(**PROMPT, sampling=SamplingParams(
            temperature=0.0, max_new_tokens=40,
            structured=StructuredOutput("grammar", grammar))).result(120)
        assert r.text.startswith("<tool_call>\n<function=get_weather>\n<parameter=city"), \
            r.text
        control = [row for row in _request_rows(rows, prompt) if row.kind is BatchKind.CONTROL]
        assert control and len(control[0].tokens) == len(prompt) + 1  # right after `<tool_call>`
