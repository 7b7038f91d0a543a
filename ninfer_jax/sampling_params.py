"""SamplingParams: one request's sampling settings and generation budget, validated.

Host-only (no jax), shared by the public API, the Engine and the Program (which turns a batch of
them into device arrays in `program/sampling.py`). Every bad value is refused at construction
with a message naming the field and its allowed range.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ninfer_jax.errors import NinferError

MAX_SEED = 2**32 - 1
MAX_TOP_K = 2**31 - 1
MAX_LOGPROBS = 20  # most alternatives per token (`logprobs`), OpenAI's top_logprobs limit
MAX_STOP_TOKEN_IDS = 16  # most `stop_token_ids` (the device holds them in a fixed-width row)
STRUCTURED_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


class SamplingParamsError(NinferError, ValueError):
    """A sampling setting is out of range; the message names the field and the range."""


@dataclasses.dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the output's text, enforced by constrained decoding (the Frontend
    compiles it against the tokenizer; a spec that does not compile is refused at submit).

    kind "json_object": any JSON object (spec None); "json_schema": JSON text matching the
    schema `spec` (a JSON string); "regex": text matching the regular expression `spec`;
    "choice": exactly one of the strings in `choices`; "grammar": a Lark grammar `spec`
    (llguidance's dialect, which embeds JSON schemas and regexes).
    """

    kind: str
    spec: str | None = None
    choices: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in STRUCTURED_KINDS:
            raise SamplingParamsError(f"structured.kind must be one of {list(STRUCTURED_KINDS)}, "
                                      f"got {self.kind!r:.40}")
        object.__setattr__(self, "choices", tuple(self.choices))
        if self.kind == "choice":
            if self.spec is not None or not self.choices or not all(
                    isinstance(c, str) and c for c in self.choices):
                raise SamplingParamsError("structured: kind 'choice' takes a non-empty list of "
                                          "non-empty strings in choices (and no spec)")
        elif self.choices:
            raise SamplingParamsError(f"structured.choices is only for kind 'choice', not "
                                      f"{self.kind!r}")
        elif self.kind == "json_object":
            if self.spec is not None:
                raise SamplingParamsError("structured.spec must be None for kind 'json_object'")
        elif not isinstance(self.spec, str) or not self.spec:
            raise SamplingParamsError(f"structured.spec must be a non-empty string for kind "
                                      f"{self.kind!r}")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings and budget, validated on construction (OpenAI defaults)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # None: the Engine draws one at submit (reported in the result)
    max_new_tokens: int = 256  # generation budget
    stop: tuple[str, ...] = ()  # stop strings: matched across tokens, never emitted
    stop_token_ids: tuple[int, ...] = ()  # more ids that end the output like EOS
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings cannot end it before this many
    ignore_eos: bool = False  # EOS ids do not end the output (stop_token_ids still do)
    skip_special_tokens: bool = True  # control tokens (not channel markup) render no text
    logprobs: int | None = None  # None: off; N >= 0: the sampled token's and N alternatives'
    structured: StructuredOutput | None = None  # constrained decoding of the output
    # Thinking budget: once the thinking channel holds this many tokens, the Frontend forces
    # the end of the block and the answer goes on in the content channel (None: no budget;
    # for no thinking at all, render the prompt with enable_thinking=False).
    max_thinking_tokens: int | None = None
    # "off": this request's rounds draft nothing, even in an Engine opened with speculation
    # ("on", the default: the Engine's draft policy chooses, `engine/spec_policy.py`).
    speculative: str = "on"

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if not isinstance(self.stop, (list, tuple)):
            raise SamplingParamsError(f"stop must be a string or a list of strings, got "
                                      f"{type(self.stop).__name__}")
        object.__setattr__(self, "stop", tuple(self.stop))
        for i, stop in enumerate(self.stop):
            if not isinstance(stop, str) or not stop:
                raise SamplingParamsError(f"stop[{i}] must be a non-empty string, got {stop!r}")
        self._check_extensions()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _CHECKED_APART or (f.name in _NONE_ALLOWED and value is None):
                continue
            is_int = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
            if f.name in _INT_RANGES:
                ok = is_int and _INT_RANGES[f.name](int(value))
            else:
                ok = (is_int or isinstance(value, (float, np.floating))) and _in_float32_range(
                    f.name, float(value)
                )
            if not ok:
                raise SamplingParamsError(f"{f.name} must be {_ALLOWED[f.name]}, got {value!r}")


    def _check_extensions(self) -> None:
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(
                self.stop_token_ids, (list, tuple)):
            raise SamplingParamsError(f"stop_token_ids must be a list of token ids, got "
                                      f"{type(self.stop_token_ids).__name__}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise SamplingParamsError(f"stop_token_ids holds at most {MAX_STOP_TOKEN_IDS} ids, "
                                      f"got {len(self.stop_token_ids)}")
        for i, t in enumerate(self.stop_token_ids):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or t < 0:
                raise SamplingParamsError(f"stop_token_ids[{i}] must be a token id >= 0, "
                                          f"got {t!r:.40}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name} must be a bool, got "
                                          f"{getattr(self, name)!r:.40}")
        if self.speculative not in ("on", "off"):
            raise SamplingParamsError(f"speculative must be 'on' or 'off', got "
                                      f"{self.speculative!r:.40}")
        n = self.logprobs
        if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer))
                              or not 0 <= n <= MAX_LOGPROBS):
            raise SamplingParamsError(f"logprobs must be None or an integer in "
                                      f"[0, {MAX_LOGPROBS}], got {n!r:.40}")
        if self.structured is not None and not isinstance(self.structured, StructuredOutput):
            raise SamplingParamsError(f"structured must be a StructuredOutput or None, got "
                                      f"{type(self.structured).__name__}")
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 0:
            raise SamplingParamsError(f"min_tokens must be an integer >= 0, got {m!r:.40}")
        if isinstance(self.max_new_tokens, (int, np.integer)) and m > self.max_new_tokens:
            raise SamplingParamsError(f"min_tokens must be <= max_new_tokens "
                                      f"({self.max_new_tokens}), got {m}")
        if self.structured is not None:  # the grammar alone decides where the output may end
            for name in ("min_tokens", "ignore_eos"):
                if getattr(self, name):
                    raise SamplingParamsError(
                        f"{name} cannot be combined with structured output: the grammar "
                        f"allows EOS exactly where its text is complete")


def _in_float32_range(name: str, value: float) -> bool:
    """Checks the float32 the device will see: 1e-50 is 0 there, and 1e39 is not finite."""
    if not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
        return False
    return _FLOAT_RANGES[name](float(np.float32(value)))


_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT_RANGES = {
    "temperature": lambda v: v >= 0,
    "top_p": lambda v: 0 < v <= 1,
    "min_p": lambda v: 0 <= v <= 1,
    "presence_penalty": lambda v: -2 <= v <= 2,
    "frequency_penalty": lambda v: -2 <= v <= 2,
    "repetition_penalty": lambda v: v > 0,
}
_INT_RANGES = {
    "top_k": lambda v: 0 <= v <= MAX_TOP_K,
    "seed": lambda v: 0 <= v <= MAX_SEED,
    "max_new_tokens": lambda v: v >= 1,
    "max_thinking_tokens": lambda v: v >= 1,
}
_ALLOWED = {
    "temperature": "a finite number >= 0 (0 = greedy)",
    "top_k": f"an integer in [0, {MAX_TOP_K}] (0 = off)",
    "top_p": "a finite number in (0, 1] (1 = off)",
    "min_p": "a finite number in [0, 1] (0 = off)",
    "presence_penalty": "a finite number in [-2, 2] (0 = off)",
    "frequency_penalty": "a finite number in [-2, 2] (0 = off)",
    "repetition_penalty": "a finite number > 0 (1 = off)",
    "seed": f"an integer in [0, {MAX_SEED}]",
    "max_new_tokens": "an integer >= 1",
    "max_thinking_tokens": "None or an integer >= 1 (no thinking: enable_thinking=False)",
}
_CHECKED_APART = frozenset({"stop", "stop_token_ids", "min_tokens", "ignore_eos",
                            "skip_special_tokens", "logprobs", "structured", "speculative"})
_NONE_ALLOWED = frozenset({"seed", "max_thinking_tokens"})
_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


def as_sampling_params(row: Any) -> SamplingParams:
    """A SamplingParams from itself, a dict of its fields, or a dataclass carrying them."""
    if isinstance(row, SamplingParams):
        return row
    if isinstance(row, Mapping):
        unknown = sorted(set(row) - set(_FIELDS))
        if unknown:
            raise SamplingParamsError(
                f"unknown sampling field(s) {unknown}; known: {list(_FIELDS)}"
            )
        return SamplingParams(**row)
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        # A request-level dataclass may carry more (max_tokens, stop, ...): read only our fields.
        return SamplingParams(**{n: getattr(row, n) for n in _FIELDS if hasattr(row, n)})
    raise SamplingParamsError(f"a sampling row must be a dict or a dataclass, got {type(row)!r}")
