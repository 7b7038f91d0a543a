"""The grammar matcher's masks against what the grammar means, on the demo tokenizer (a
sentencepiece vocabulary with byte fallback, 4096 ids, EOS ids 1 and 3).

For a choice grammar every reachable state is checked exhaustively: an allowed token keeps the
text a prefix of some choice (llguidance may allow fewer: inside a forced stretch it keeps the
canonical tokens), the EOS ids are allowed exactly when the text is a whole choice, no state is
stuck, and every choice is reached. A regex and a JSON schema are checked along random allowed walks: every
allowed token keeps the text a prefix of a match (checked with the `regex` module's partial
matching, and by completing JSON with the schema's validator at the end). Also: masks are as
wide as the model's vocabulary with nothing allowed past the tokenizer's, the matcher follows
exactly the committed tokens (a rejected token leaves an error), and the mask costs tens of
microseconds per token (printed; asserted below 2 ms so a pathological regression fails).
"""

from __future__ import annotations

import json
import pathlib
import random
import time

import jsonschema
import numpy as np
import pytest
import regex

import ninfer_jax
from ninfer_jax.frontend import Frontend
from ninfer_jax.frontend.grammar import GrammarCompiler, GrammarError, allowed_ids
from ninfer_jax.sampling_params import StructuredOutput

FRONTEND = Frontend.load(pathlib.Path(ninfer_jax.__file__).parent / "assets" / "demo")
TOK = FRONTEND.tokenizer
EOS = sorted(TOK.eos_ids)
MODEL_VOCAB = TOK.vocab_size + 70  # a model vocabulary padded past the tokenizer's


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(TOK, MODEL_VOCAB)


def _text(ids) -> bytes:
    return b"".join(TOK.token_bytes(i) for i in ids)


def test_choice_masks_exhaustively(compiler):
    choices = ("yes", "no", "not sure", "n/a")
    encoded = [c.encode() for c in choices]
    matcher = compiler.matcher(StructuredOutput("choice", choices=choices))
    frontier = [(matcher, [])]
    states, reached = 0, set()
    while frontier:
        m, ids = frontier.pop()
        states += 1
        mask = m.mask()
        assert mask.shape == (compiler.mask_words,) and mask.dtype == np.uint32
        allowed = set(allowed_ids(mask).tolist())
        assert max(allowed) < TOK.vocab_size
        text = _text(ids)
        want = {t for t in range(TOK.vocab_size) if t not in TOK.special_tokens.values()
                and _text([t]) and any(c.startswith(text + _text([t])) for c in encoded)}
        assert allowed - set(EOS) <= want, (text, sorted(allowed - want)[:5])
        assert (set(EOS) <= allowed) == (text in encoded), text
        assert allowed, text  # never stuck: some token continues every reachable state
        if text in encoded:
            reached.add(text)
        for t in sorted(allowed - set(EOS)):
            child = compiler.matcher(StructuredOutput("choice", choices=choices))
            assert child.advance(ids + [t])
            frontier.append((child, ids + [t]))
    assert states > len(choices)
    assert reached == set(encoded)  # every choice can be produced


def _walk(compiler, spec, rng, max_steps=80):
    """A random walk through allowed tokens until EOS; returns (text, per-token mask seconds)."""
    m = compiler.matcher(spec)
    ids, times = [], []
    for _ in range(max_steps):
        start = time.perf_counter()
        allowed = allowed_ids(m.mask())
        times.append(time.perf_counter() - start)
        t = int(rng.choice(allowed.tolist()))
        if t in EOS:
            assert m.is_accepting
            return _text(ids).decode(), times
        assert m.advance([t]), m.error
        ids.append(t)
        yield_text = _text(ids).decode("utf-8", errors="ignore")
        if spec.kind == "regex":
            assert regex.fullmatch(spec.spec, yield_text, partial=True), yield_text
    return None, times


def test_regex_walks_stay_inside_the_language(compiler):
    spec = StructuredOutput("regex", r"[A-Z][a-z]{1,5}-[0-9]{2,3}( ok)?")
    rng = random.Random(0)
    for _ in range(20):
        text, _ = _walk(compiler, spec, rng)
        assert text is not None and regex.fullmatch(spec.spec, text), text


def test_json_schema_walks_validate(compiler):
    schema = {"type": "object", "additionalProperties": False, "required": ["id", "tags"],
              "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 500},
                             "ok": {"type": "boolean"},
                             "tags": {"type": "array", "maxItems": 3,
                                      "items": {"enum": ["x", "yy", "zzz"]}},
                             "name": {"type": "string", "maxLength": 6}}}
    spec = StructuredOutput("json_schema", json.dumps(schema))
    rng = random.Random(1)
    times = []
    for _ in range(15):
        text, t = _walk(compiler, spec, rng, max_steps=200)
        times += t
        assert text is not None
        jsonschema.validate(json.loads(text), schema)
    median_us = float(np.median(times)) * 1e6
    print(f"mask: median {median_us:.1f} us per token over {len(times)} tokens")
    assert median_us < 2000


def test_matcher_follows_committed_tokens(compiler):
    m = compiler.matcher(StructuredOutput("choice", choices=("ab",)))
    a, b = TOK.encode_text("a")[-1], TOK.encode_text("b")[-1]
    before = m.mask()
    assert m.mask() is before  # cached until the next advance
    forced = m.mask_after([a])  # forced tokens: the mask after them, nothing consumed
    assert b in allowed_ids(forced) and np.array_equal(m.mask(), before)
    with pytest.raises(GrammarError):
        m.mask_after([b])
    assert np.array_equal(m.mask(), before)
    assert not m.advance([b]) and m.error


@pytest.mark.parametrize("spec", [
    StructuredOutput("regex", "(a"), StructuredOutput("json_schema", "{"),
    StructuredOutput("json_schema", '{"type": "nope"}'), StructuredOutput("json_schema", "[1]"),
    StructuredOutput("grammar", "start: undefined_rule")])
def test_bad_specs_are_grammar_errors(compiler, spec):
    with pytest.raises(GrammarError):
        compiler.compile(spec)


@pytest.mark.parametrize("spec, reason", [
    (StructuredOutput("json_schema", json.dumps({
        "type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]})),
     "Too many items"),
    (StructuredOutput("regex", "a{1000000}"), "too many expressions constructed")])
def test_specs_that_overflow_at_the_first_token_fail_to_compile(compiler, spec, reason):
    """They validate, but llguidance gave up at the first token (#41: the request failed after
    its answer began); the reason comes without llguidance's parser state."""
    with pytest.raises(GrammarError, match=reason) as err:
        compiler.compile(spec)
    assert "<state>" not in str(err.value) and "Parser:" not in str(err.value)


def test_json_schema_integers_without_bounds_get_int64_bounds():
    """An integer the schema leaves unbounded is bounded to int64 (so a model repeating a digit
    is stopped); a schema's own bounds, enum data and non-integers are kept as written."""
    from ninfer_jax.frontend.grammar import INT64_BOUND, bounded_integers

    schema = {"type": "object", "properties": {
        "n": {"type": "integer"}, "m": {"type": "integer", "maximum": 7},
        "xs": {"type": "array", "items": {"type": ["integer", "null"]}},
        "e": {"enum": [{"type": "integer"}]}, "f": {"type": "number"},
        "any": {"anyOf": [{"type": "integer"}, {"type": "string"}]}},
        "$defs": {"d": {"type": "integer"}}}
    out = bounded_integers(schema)
    bound = {"minimum": -INT64_BOUND, "maximum": INT64_BOUND}
    props = out["properties"]
    assert props["n"] == {"type": "integer", **bound} and props["m"] == schema["properties"]["m"]
    assert props["xs"]["items"] == {"type": ["integer", "null"], **bound}
    assert props["e"] == schema["properties"]["e"] and props["f"] == {"type": "number"}
    assert props["any"]["anyOf"][0] == {"type": "integer", **bound}
    assert out["$defs"]["d"] == {"type": "integer", **bound}
    assert schema["properties"]["n"] == {"type": "integer"}  # the caller's schema untouched
    # Through a compiled json_schema: the digits stop within int64.
    compiler = GrammarCompiler(TOK)
    m = compiler.matcher(StructuredOutput("json_schema", json.dumps(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})))
    assert m.advance(TOK.encode('{"n": '))
    digits = 0
    while TOK.encode("9")[0] in set(allowed_ids(m.mask()).tolist()):
        assert m.advance(TOK.encode("9"))
        digits += 1
    assert digits == 18 and str(INT64_BOUND).startswith("9223")
