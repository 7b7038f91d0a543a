"""Parses Anthropic Messages bodies (and count_tokens ones) into a `GenerationRequest`
(`requests.py` holds what the parsers share; `anthropic_api.py` renders the answers)."""

from __future__ import annotations

from typing import Any

from ninfer_jax.gateway.http.errors import Api, ApiError
from ninfer_jax.gateway.http.fields import Fields, check_text
from ninfer_jax.gateway.http.requests import (
    COUNT_TOKENS_FIELDS,
    MESSAGES_FIELDS,
    GenerationRequest,
    copy_fields,
    isolation,
    reject_unknown,
    session_of,
)
from ninfer_jax.gateway.http.structured import thinking_off
from ninfer_jax.gateway.http.tools import anthropic_content, anthropic_tool_choice, anthropic_tools


def parse_messages(obj: Any, session_header: str | None, *,
                   count_only: bool = False) -> GenerationRequest:
    """`POST /v1/messages` (Anthropic Messages); `count_only`: a count_tokens body (no
    generation settings)."""
    body = Fields(obj)
    reject_unknown(body, COUNT_TOKENS_FIELDS if count_only else MESSAGES_FIELDS)
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if isinstance(system, (str, list)):
        messages.append({"role": "system", "content": body.text_content("system")})
    elif body.has("system"):
        raise ApiError.invalid("system", "expected a string or an array of text blocks",
                               code="invalid_type")
    for i, raw in enumerate(body.array("messages", required=True)):
        m = Fields(raw, f"messages[{i}]")
        role = m.string("role", required=True)
        if role not in ("user", "assistant"):
            raise ApiError.invalid(m.name("role"), f"must be 'user' or 'assistant', "
                                   f"got {role!r:.40}")
        messages.extend(anthropic_content(m, role))
    if len(messages) == (1 if messages and messages[0]["role"] == "system" else 0):
        raise ApiError.invalid("messages", "must not be empty")
    tools = anthropic_tools(body)
    choice = anthropic_tool_choice(body, tools)
    sampling: dict[str, Any] = {}
    copy_fields(body, sampling, Fields.number, ("temperature", "top_p"))
    copy_fields(body, sampling, Fields.integer, ("top_k",))
    sampling["stop"] = body.stop("stop_sequences")
    max_tokens = body.integer("max_tokens", required=not count_only)
    thinking = False  # Anthropic's default: no thinking unless the request enables it
    config = body.obj("thinking")
    if config is not None:
        kind = config.string("type", required=True)
        if kind not in ("enabled", "disabled", "adaptive"):
            raise ApiError.invalid("thinking.type", f"must be 'enabled', 'adaptive' or "
                                   f"'disabled', got {kind!r:.40}")
        thinking = kind != "disabled"
        budget = config.integer("budget_tokens", required=kind == "enabled")
        if budget is not None:
            if kind != "enabled":
                raise ApiError.invalid("thinking.budget_tokens", "only with type 'enabled'")
            if budget < 1:
                raise ApiError.invalid("thinking.budget_tokens", f"must be >= 1, got {budget}")
            if max_tokens is not None and budget >= max_tokens:
                raise ApiError.invalid("thinking.budget_tokens", f"must be less than "
                                       f"max_tokens ({max_tokens}), got {budget}")
            sampling["max_thinking_tokens"] = budget  # the thinking block ends there
    if choice.forced and thinking:  # as Anthropic: forced tool use needs thinking off
        thinking_off(True, "thinking")
    metadata = body.obj("metadata")
    session = session_of(metadata, session_header, "user_id") if metadata is not None \
        else (check_text(session_header, "x-session-id") if session_header else None)
    return GenerationRequest(
        api=Api.ANTHROPIC, model=body.string("model"), messages=messages, sampling=sampling,
        tools=tools if choice.mode != "none" else None,
        parse_tools=bool(tools) and choice.mode != "none",
        forced_tools=choice if choice.forced else None,
        max_tokens=max_tokens, stream=bool(body.boolean("stream")), enable_thinking=thinking,
        session=session, field_names={"max_new_tokens": "max_tokens", "stop": "stop_sequences",
                                      "max_thinking_tokens": "thinking.budget_tokens"},
        **isolation(body))
