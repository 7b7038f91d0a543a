"""What a request's consumer sees: events, the final result, usage, and the Engine's errors.

Owns the public event vocabulary (DESIGN §3): one `GenerationStart` after admission, `Delta`s of
committed output, exactly one `Finished`. Pure data; no behaviour.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence

from ninfer_jax import display
from ninfer_jax.errors import NinferError


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS or a stop string
    LENGTH = "length"  # max_new_tokens reached
    CANCELLED = "cancelled"  # the consumer cancelled or dropped the handle
    DEADLINE = "deadline"  # the request's deadline passed while it was running
    ERROR = "error"  # rejected, or the Engine failed; see Finished.error


class Channel(enum.Enum):
    CONTENT = "content"
    THINKING = "thinking"


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of completion_tokens, those published on the thinking channel


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and its most likely alternatives, under the
    distribution the token was drawn from (after penalties and temperature, before top-k/top-p;
    with constrained decoding, after the grammar's mask). A token of forced control (e.g. the
    end of a thinking block at its budget) was not drawn: log-prob 0.0, no alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclasses.dataclass(frozen=True)
class GenerationStart:
    """Published once after admission, before any delta."""

    request_id: int
    prompt_tokens: int
    cached_tokens: int


@dataclasses.dataclass(frozen=True)
class Delta:
    """Committed output of one model step for one request (text may be empty while held)."""

    request_id: int
    text: str
    token_ids: tuple[int, ...]
    channel: Channel
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token_ids entry, when asked


@dataclasses.dataclass(frozen=True)
class Finished:
    request_id: int
    finish_reason: FinishReason
    usage: Usage
    error: str | None = None  # set when finish_reason is ERROR
    stop_string: str | None = None  # the stop string that ended it (finish_reason STOP)


Event = GenerationStart | Delta | Finished


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    request_id: int
    text: str
    reasoning_text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    usage: Usage
    seed: int | None  # the seed used for sampling (drawn by the Engine when none was given)
    error: str | None = None
    stop_string: str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token_ids entry, when asked
    # The model's detokenizer, for showing each token's text (notebook display only).
    decode: Callable[[Sequence[int]], str] | None = dataclasses.field(
        default=None, repr=False, compare=False)

    def _repr_html_(self) -> str:
        return display.generation_html(self)

    _repr_pretty_ = display.pretty(display.generation_line)


class EngineError(NinferError):
    """Base of errors raised to the submitting caller."""


class RejectedError(EngineError):
    """A request was refused before any Program mutation (reason in `.reason`, field named)."""

    def __init__(self, reason: str, message: str, field: str | None = None):
        super().__init__(message)
        self.reason = reason  # "overload" | "invalid" | "too_long" | "unavailable"
        self.field = field  # the request field at fault, when one is


class InvariantError(RuntimeError):
    """An Engine invariant broke: shared state can no longer be explained; the Engine fails
    (its requests end with an "engine_failed" error; callers see EngineFailedError)."""


class EngineFailedError(EngineError):
    """The Engine failed (an internal invariant broke); it accepts no more requests."""
