"""A submitted request's checks and its output's opening, on the submitting thread, before it
takes capacity.

Every refusal is a RejectedError naming the field and the limit; nothing here mutates the
Engine, so a refused call leaves it exactly as it was.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import TYPE_CHECKING

from ninfer_jax.engine.events import RejectedError
from ninfer_jax.frontend.prompt import PreparedPrompt
from ninfer_jax.program.host import HostProgram
from ninfer_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ninfer_jax.frontend.grammar import GrammarMatcher
    from ninfer_jax.frontend.loading import Frontend
    from ninfer_jax.frontend.output_session import OutputSession


def check_request(program: HostProgram, prompt: object, sampling: object) -> None:
    """Raises RejectedError naming the field when a request cannot be served: a prompt not
    prepared by a Frontend, ids outside the vocabulary, a context or budget past the limits,
    media the Program does not take."""
    if not isinstance(prompt, PreparedPrompt):
        raise RejectedError("invalid", f"prompt must be a PreparedPrompt (Frontend.prepare), "
                            f"got {type(prompt).__name__}", "prompt")
    if not isinstance(sampling, SamplingParams):
        raise RejectedError("invalid", f"sampling must be a SamplingParams, got "
                            f"{type(sampling).__name__}", "sampling")
    n, lim = len(prompt.token_ids), program.limits
    b = prompt.reuse_boundary
    if b is not None and (isinstance(b, bool) or not isinstance(b, int) or not 0 < b < n):
        raise RejectedError("invalid", f"prompt.reuse_boundary must be None or an int in "
                            f"(0, {n}), got {b!r:.40}", "prompt")
    for i, t in enumerate(sampling.stop_token_ids):
        if t >= lim.vocab_size:
            raise RejectedError("invalid", f"stop_token_ids[{i}]: {t} is outside the "
                                f"vocabulary [0, {lim.vocab_size})", "stop_token_ids")
    if n + 1 > lim.max_seq_len:
        raise RejectedError("too_long", f"prompt has {n} tokens; the context limit "
                            f"max_seq_len is {lim.max_seq_len} (prompt + at least 1 new token)",
                            "prompt")
    try:
        program.check_admissible(n, sampling.max_new_tokens)
    except ValueError as e:
        raise RejectedError("too_long", f"max_new_tokens: {e}", "max_new_tokens") from None
    if prompt.media:
        try:
            program.check_media(prompt.token_ids, prompt.media)
        except ValueError as e:
            raise RejectedError("invalid", f"messages: {e}", "messages") from None


def seconds(name: str, value: object) -> float | None:
    """A time limit in seconds: None, or a finite number > 0 (NaN would never fire)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value <= 0:
        raise RejectedError("invalid", f"{name} must be a finite number of seconds > 0, "
                            f"got {value!r:.40}", name)
    return float(value)


def optional_text(name: str, value: object) -> str | None:
    if value is not None and not isinstance(value, str):
        raise RejectedError("invalid", f"{name} must be a string or None, got "
                            f"{type(value).__name__}", name)
    return value


def open_output(frontend: Frontend, prompt: PreparedPrompt, sampling: SamplingParams,
                vocab_size: int) -> tuple[SamplingParams, OutputSession, GrammarMatcher | None]:
    """The request's sampling (a sampled request without a seed gets one drawn here, so its
    handle can report it), its Frontend OutputSession and, for structured output, its grammar
    matcher with the first token's mask computed here rather than on the worker."""
    if sampling.temperature > 0 and sampling.seed is None:
        sampling = dataclasses.replace(sampling, seed=int.from_bytes(os.urandom(4), "little"))
    session = frontend.open_session(
        prompt, stop=sampling.stop, stop_token_ids=sampling.stop_token_ids,
        ignore_eos=sampling.ignore_eos, min_tokens=sampling.min_tokens,
        skip_special_tokens=sampling.skip_special_tokens,
        max_thinking_tokens=sampling.max_thinking_tokens)
    grammar = None
    if sampling.structured is not None:
        if session.channel.value == "thinking":
            raise RejectedError("invalid", "structured output constrains the answer from its "
                                "first token: render the prompt with thinking off", "structured")
        try:
            grammar = frontend.grammar(vocab_size).matcher(sampling.structured)
            grammar.mask()
        except ValueError as e:
            raise RejectedError("invalid", f"structured: {e}", "structured") from None
    return sampling, session, grammar
