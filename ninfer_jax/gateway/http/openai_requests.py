"""Parses OpenAI chat-completions and completions bodies into a `GenerationRequest`
(`requests.py` holds what the parsers share; `openai_api.py` renders the answers)."""

from __future__ import annotations

from typing import Any

from ninfer_jax.gateway.http.errors import Api, ApiError
from ninfer_jax.gateway.http.fields import Fields, check_text
from ninfer_jax.gateway.http.requests import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    GenerationRequest,
    constrain,
    isolation,
    num_choices,
    openai_content,
    openai_sampling,
    reasoning_effort,
    refuse_unsupported,
    reject_unknown,
    session_of,
    stream_options,
)
from ninfer_jax.gateway.http.structured import openai_structured
from ninfer_jax.gateway.http.tools import openai_tool_calls, openai_tool_choice, openai_tools

_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
               "assistant": "assistant", "tool": "tool"}


def parse_chat(obj: Any, session_header: str | None) -> GenerationRequest:
    """`POST /v1/chat/completions`."""
    body = Fields(obj)
    reject_unknown(body, CHAT_FIELDS)
    if body.has("best_of"):
        raise ApiError.invalid("best_of", "is a completions field", code="unsupported_parameter")
    n = num_choices(body)
    refuse_unsupported(body, lists=("functions", "logit_bias"))
    if body.has("function_call"):
        raise ApiError.invalid("function_call", "the legacy functions API is not supported; "
                               "use tools", code="unsupported_parameter")
    body.boolean("parallel_tool_calls")  # several calls are always parsed
    tools = openai_tools(body)
    choice = openai_tool_choice(body, tools)
    structured = openai_structured(body)
    messages = []
    for i, raw in enumerate(body.array("messages", required=True)):
        m = Fields(raw, f"messages[{i}]")
        role = m.string("role", required=True)
        if role not in _CHAT_ROLES:
            raise ApiError.invalid(m.name("role"), f"must be one of {sorted(_CHAT_ROLES)}, "
                                   f"got {role!r:.40}")
        calls = openai_tool_calls(m) if role == "assistant" else None
        if m.has("tool_calls") and role != "assistant":
            raise ApiError.invalid(m.name("tool_calls"), "only assistant messages have tool calls")
        empty = calls is not None and not m.has("content")  # content null with tool calls
        message: dict[str, Any] = {"role": _CHAT_ROLES[role],
                                   "content": "" if empty else openai_content(m, role)}
        if calls is not None:
            message["tool_calls"] = calls
        if role == "tool":
            message["tool_call_id"] = m.string("tool_call_id") or ""
        reasoning = m.string("reasoning_content")
        if reasoning is not None and role == "assistant":
            message["reasoning_content"] = reasoning
        messages.append(message)
    if not messages:
        raise ApiError.invalid("messages", "must not be empty")
    budget_key = "max_completion_tokens" if body.has("max_completion_tokens") else "max_tokens"
    stream = bool(body.boolean("stream"))
    thinking = body.boolean("enable_thinking")
    kwargs = body.obj("chat_template_kwargs")
    if thinking is None and kwargs is not None:
        thinking = kwargs.boolean("enable_thinking")
    sampling = openai_sampling(body)
    thinking = reasoning_effort(body, "reasoning_effort", sampling, thinking)
    names = {"max_new_tokens": budget_key}
    thinking = constrain(structured, choice, thinking, sampling, names,
                         "reasoning_effort" if body.has("reasoning_effort") else
                         "enable_thinking")
    top = body.integer("top_logprobs")
    if body.boolean("logprobs"):
        sampling["logprobs"] = 0 if top is None else top
    elif top is not None:
        raise ApiError.invalid("top_logprobs", "needs logprobs: true")
    return GenerationRequest(
        api=Api.OPENAI, model=body.string("model"), messages=messages, n=n,
        tools=tools if choice.mode != "none" else None,
        parse_tools=bool(tools) and choice.mode != "none",
        forced_tools=choice if choice.forced else None,
        sampling=sampling, max_tokens=body.integer(budget_key), stream=stream,
        **stream_options(body, stream), enable_thinking=thinking,
        session=session_of(body, session_header), field_names=names,
        **isolation(body))


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompt_batch(prompt: Any) -> list[str | list[int]]:
    """The prompts of `prompt`: a string, token ids, or a non-empty list of either."""
    if isinstance(prompt, str) or _is_ids(prompt):
        return [check_text(prompt, "prompt") if isinstance(prompt, str) else prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError.invalid("prompt", "expected a string, an array of token ids, or a "
                               "non-empty array of either", code="invalid_type")
    out = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            out.append(check_text(p, f"prompt[{i}]"))
        elif _is_ids(p):
            out.append(p)
        else:
            raise ApiError.invalid(f"prompt[{i}]", "expected a string or a non-empty array of "
                                   "token ids", code="invalid_type")
    return out


def parse_completion(obj: Any, session_header: str | None) -> GenerationRequest:
    """`POST /v1/completions`: a prompt (a string or token ids) or a batch of them."""
    body = Fields(obj)
    reject_unknown(body, COMPLETION_FIELDS)
    refuse_unsupported(body, lists=("logit_bias",))
    if body.string("suffix"):
        raise ApiError.invalid("suffix", "not supported yet", code="unsupported_parameter")
    batch = _prompt_batch(body.required("prompt"))
    n = num_choices(body, len(batch))
    text, ids = (batch[0], None) if isinstance(batch[0], str) else (None, batch[0])
    stream = bool(body.boolean("stream"))
    sampling = openai_sampling(body)
    logprobs = body.integer("logprobs")
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    echo = bool(body.boolean("echo"))
    if echo and stream:
        raise ApiError.invalid("echo", "is not supported with stream (ask without streaming)",
                               code="unsupported_parameter")
    names = {"max_new_tokens": "max_tokens", "prompt_token_ids": "prompt"}
    structured = openai_structured(body)
    if structured is not None:  # a raw prompt: the caller decides what the prompt opens
        sampling["structured"], names["structured"] = structured
    return GenerationRequest(
        api=Api.OPENAI, model=body.string("model"), prompt=text, prompt_token_ids=ids,
        more_prompts=tuple(batch[1:]), n=n,
        sampling=sampling, max_tokens=body.integer("max_tokens"), stream=stream, echo=echo,
        **stream_options(body, stream),
        enable_thinking=body.boolean("enable_thinking"), session=session_of(body, session_header),
        field_names=names, **isolation(body))
