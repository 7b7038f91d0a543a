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


class SamplingParamsError(NinferError, ValueError):
    """A sampling setting is out of range; the message names the field and the range."""


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
    # Thinking budget: once the thinking channel holds this many tokens, the Frontend forces
    # the end of the block and the answer goes on in the content channel (None: no budget;
    # for no thinking at all, render the prompt with enable_thinking=False).
    max_thinking_tokens: int | None = None

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
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "stop" or (f.name in ("seed", "max_thinking_tokens") and value is None):
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
