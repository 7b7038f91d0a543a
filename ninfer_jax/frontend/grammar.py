"""Constrained decoding's host side: a request's grammar compiled against the tokenizer, and
the per-request matcher that says which tokens may come next.

Owns (DESIGN §2: the Frontend owns the tokenizer) the translation of a `StructuredOutput`
(JSON object, JSON schema, regex, choice, Lark grammar) into an llguidance grammar, its
validation (a spec that does not compile is a `GrammarError` naming the problem), and
`GrammarMatcher`: one per request, advanced with exactly the tokens the Engine commits, whose
`mask()` is the allowed-token bitmask of the next sampled token, [ceil(V / 32)] uint32 with bit
i of word j standing for token 32 j + i (V: the model's vocabulary, which may be larger than the
tokenizer's; ids past the tokenizer's are never allowed). The EOS ids are allowed only where
the grammar accepts the text so far. The Program applies the mask on the device
(`program/sampling.py`); nothing here knows about batches or devices.

Why llguidance: a Rust library without torch (CI has none; xgrammar's Python package pulls
torch), with JSON schema, regex, Lark and choice front ends, and a mask computed in tens of
microseconds per token on the demo vocabulary (measured in `tests/frontend/test_grammar.py`).
"""

from __future__ import annotations

import functools
import json
from typing import Any

import llguidance
import numpy as np

from ninfer_jax.frontend.tokenizer import Tokenizer
from ninfer_jax.sampling_params import StructuredOutput


class GrammarError(ValueError):
    """A structured-output spec that does not compile; the message says why."""


class _TokenizerView:
    """What llguidance's TokenizerWrapper reads: every token's bytes, the special ids, EOS."""

    def __init__(self, tokenizer: Tokenizer):
        self._tokenizer = tokenizer
        self.eos_token_id = min(tokenizer.eos_ids) if tokenizer.eos_ids else None
        self.bos_token_id = None
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(set(tokenizer.special_tokens.values()))

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode_text(text.decode("utf-8", errors="replace"))


# llguidance reads schema bounds as f64, where 2**63 - 1 rounds past int64: this is the largest
# f64 below 2**63, so every integer a bounded schema allows fits an int64.
INT64_BOUND = 2**63 - 1024
NUMERIC_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
           "propertyNames", "unevaluatedItems", "unevaluatedProperties")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def bounded_integers(schema: Any) -> Any:
    """`schema` with int64 bounds on every integer it allows without a bound: a grammar that
    allows digits forever lets a model that repeats one write until its budget runs out (a
    forced tool call then never closes). Schemas with a bound of their own are kept."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA:
        if isinstance(schema.get(key), dict):
            out[key] = bounded_integers(schema[key])
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [bounded_integers(s) for s in schema[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {k: bounded_integers(v) for k, v in schema[key].items()}
    kind = schema.get("type")
    if (kind == "integer" or (isinstance(kind, list) and "integer" in kind)) and \
            not any(k in schema for k in NUMERIC_BOUNDS):
        out["minimum"], out["maximum"] = -INT64_BOUND, INT64_BOUND
    return out


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of `spec` (not yet checked against a tokenizer)."""
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.spec)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError("the schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(
            bounded_integers(schema), defaults={"whitespace_flexible": False,
                                                "item_separator": ", ", "key_separator": ": "})
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.spec)
    if spec.kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in spec.choices))
    return llguidance.LLMatcher.grammar_from_lark(spec.spec)


class GrammarCompiler:
    """Compiles specs against one tokenizer; `matcher(spec)` opens a request's matcher.
    `vocab_size`: the model's vocabulary (the mask's width), at least the tokenizer's."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None):
        vocab_size = tokenizer.vocab_size if vocab_size is None else vocab_size
        if vocab_size < tokenizer.vocab_size:
            raise ValueError(f"vocab_size {vocab_size} is below the tokenizer's "
                             f"{tokenizer.vocab_size}")
        self.vocab_size = vocab_size
        self.mask_words = -(-vocab_size // 32)
        self.eos_ids = tuple(sorted(tokenizer.eos_ids))
        self._tokenizer = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_TokenizerView(tokenizer)),
            eos_token=list(self.eos_ids) or None)

    @functools.lru_cache(maxsize=256)  # noqa: B019 (one compiler per Frontend, kept for its life)
    def compile(self, spec: StructuredOutput) -> str:
        """The checked grammar of `spec`; raises GrammarError with llguidance's reason."""
        if not isinstance(spec, StructuredOutput):
            raise GrammarError(f"expected a StructuredOutput, got {type(spec).__name__}")
        try:
            grammar = grammar_text(spec)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer)
        if error:
            raise GrammarError(_first_lines(error))
        self._probe(grammar)
        return grammar

    def _probe(self, grammar: str) -> None:
        """Opens a matcher and takes its first steps (the forced prefix, the first mask, one
        allowed token): a grammar that validates can still exceed llguidance's limits there
        (a schema that requires itself: "Too many items"; `a{1000000}`: "too many expressions
        constructed"), which would otherwise fail the request after its answer began."""
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        probe = GrammarMatcher(self, matcher)  # raises on a matcher born in error
        forced = probe.forced()
        if matcher.is_error():
            raise GrammarError(_first_lines(matcher.get_error()))
        if forced:
            probe.advance(forced)
        mask = probe.mask()  # raises GrammarError
        step = next((int(t) for t in allowed_ids(mask) if int(t) not in self.eos_ids), None)
        if step is not None and not probe.advance([step]) and matcher.is_error():
            raise GrammarError(_first_lines(matcher.get_error()))

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for one request's output."""
        return GrammarMatcher(self, llguidance.LLMatcher(self._tokenizer, self.compile(spec),
                                                         log_level=0))


class GrammarMatcher:
    """One request's position in its grammar. `mask()` is cached until the next `advance`."""

    def __init__(self, compiler: GrammarCompiler, matcher: llguidance.LLMatcher):
        self._compiler = compiler
        self._matcher = matcher
        self._mask: np.ndarray | None = None
        self._rejected: str | None = None
        if matcher.is_error():
            raise GrammarError(_first_lines(matcher.get_error()))

    @property
    def error(self) -> str | None:
        """Why the matcher stopped following the output (a token it could not accept)."""
        if self._matcher.is_error():
            return _first_lines(self._matcher.get_error())
        return self._rejected

    @property
    def is_accepting(self) -> bool:
        """The text so far is a complete match (EOS may come next)."""
        return self._matcher.is_accepting()

    def mask(self) -> np.ndarray:
        """The tokens allowed next: [mask_words] uint32 (read-only; see the module docstring)."""
        if self._mask is None:
            self._mask = self._fill()
        return self._mask

    def forced(self) -> tuple[int, ...]:
        """The tokens the grammar allows next and nothing else, in the tokenizer's canonical
        split (llguidance's fast-forward tokens, e.g. `{"name": "` after a schema's start or
        a named tool's call prefix); empty where more than one continuation is allowed. The
        Engine commits them as forced control: one step, no sampling, no RNG draw."""
        if self._matcher.is_stopped() or self._matcher.is_error():
            return ()
        return tuple(self._matcher.compute_ff_tokens())

    def mask_after(self, forced: tuple[int, ...] | list[int]) -> np.ndarray:
        """The mask after `forced` tokens, leaving the matcher where it is (forced control
        computes the token after tokens not yet committed). A forced token the grammar does
        not accept raises GrammarError."""
        n = self._matcher.try_consume_tokens(list(forced))
        try:
            if n != len(forced):
                raise GrammarError(f"forced token {forced[n]} breaks the grammar")
            return self._fill()
        finally:
            self._matcher.rollback(n)

    def advance(self, token_ids) -> bool:
        """Consumes committed tokens; False (and `error` set) when the grammar rejects one.
        An EOS id after a complete match ends the grammar's part of the output."""
        self._mask = None
        for t in (int(t) for t in token_ids):
            if self._matcher.is_stopped():  # complete: only the EOS that ends the output
                if t in self._compiler.eos_ids:
                    continue
                self._rejected = f"token {t} after the grammar's complete match"
                return False
            if not self._matcher.consume_token(t):
                return False
        return True

    def _fill(self) -> np.ndarray:
        words = np.zeros(self._compiler.mask_words, np.uint32)
        view = words[: -(-self._compiler._tokenizer.vocab_size // 32)]
        self._matcher.unsafe_compute_mask_ptr(view.ctypes.data, view.nbytes)
        if self._matcher.is_error():
            raise GrammarError(_first_lines(self._matcher.get_error()))
        words.flags.writeable = False
        return words


def allowed_ids(mask: np.ndarray) -> np.ndarray:
    """The token ids a [W] uint32 mask allows, ascending."""
    bits = np.unpackbits(np.ascontiguousarray(mask, np.uint32).view(np.uint8), bitorder="little")
    return np.flatnonzero(bits).astype(np.int64)


def _first_lines(message: str, limit: int = 400) -> str:
    """llguidance's reason, on one line, without the parser state it appends."""
    message = message.split("<state>", 1)[0]
    text = " ".join(line.strip() for line in message.strip().splitlines() if line.strip())
    return text[:limit]
