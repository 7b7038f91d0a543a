"""Parses OpenAI Responses bodies into a `GenerationRequest`: `input` as a string or a list of
message / `function_call` / `function_call_output` items, `instructions`, `max_output_tokens`,
function `tools`, `reasoning.effort` (`requests.py` holds what the parsers share;
`responses_api.py` renders the answers)."""

from __future__ import annotations

from typing import Any

from ninfer_jax.frontend.tool_calls import history_arguments
from ninfer_jax.gateway.http.errors import Api, ApiError
from ninfer_jax.gateway.http.fields import MISSING, Fields
from ninfer_jax.gateway.http.requests import (
    GenerationRequest,
    constrain,
    copy_fields,
    isolation,
    reasoning_effort,
    reject_unknown,
    session_of,
)
from ninfer_jax.gateway.http.structured import openai_structured
from ninfer_jax.gateway.http.tools import openai_tool_choice, openai_tools

FIELDS = frozenset({"model", "input", "instructions", "max_output_tokens", "temperature",
                    "top_p", "stream", "tools", "tool_choice", "parallel_tool_calls", "store",
                    "previous_response_id", "reasoning", "text", "metadata", "user",
                    "service_tier", "truncation", "include", "cache_salt",
                    "allow_control_tokens", "seed", "top_k", "prompt_cache_key"})


def _messages(body: Fields) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    instructions = body.string("instructions")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    raw = body.required("input")
    if isinstance(raw, str):
        return [*messages, {"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise ApiError.invalid("input", "expected a string or a non-empty array of items",
                               code="invalid_type")
    for i, item in enumerate(raw):
        it = Fields(item, f"input[{i}]")
        kind = it.string("type") or "message"
        if kind == "message":
            role = it.string("role", required=True)
            if role not in ("user", "assistant", "system", "developer"):
                raise ApiError.invalid(it.name("role"), f"must be user, assistant, system or "
                                       f"developer, got {role!r:.40}")
            text = it.text_content("content", part_types=("input_text", "output_text", "text"))
            messages.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "function_call":
            try:
                arguments = history_arguments(it.string("arguments") or "", it.name("arguments"))
            except ValueError as e:
                raise ApiError.invalid(*str(e).split(": ", 1)) from None
            call = {"id": it.string("call_id", required=True), "type": "function",
                    "function": {"name": it.string("name", required=True),
                                 "arguments": arguments}}
            if messages and messages[-1]["role"] == "assistant" and not messages[-1].get(
                    "closed"):
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            text = it.text_content("output", part_types=("input_text", "text"))
            messages.append({"role": "tool", "content": text,
                             "tool_call_id": it.string("call_id", required=True)})
        elif kind == "reasoning":
            continue  # a returned reasoning item: the template drops earlier turns' thoughts
        else:
            raise ApiError.invalid(it.name("type"), f"{kind!r:.40} items are not supported",
                                   code="unsupported_content")
    return messages


def parse_responses(obj: Any, session_header: str | None) -> GenerationRequest:
    """`POST /v1/responses`."""
    body = Fields(obj)
    reject_unknown(body, FIELDS)
    if body.has("previous_response_id"):
        raise ApiError.invalid("previous_response_id", "responses are not stored; send the "
                               "conversation in input", code="unsupported_parameter")
    if body.boolean("store"):
        raise ApiError.invalid("store", "responses are not stored", code="unsupported_parameter")
    if body.array("include"):
        raise ApiError.invalid("include", "not supported", code="unsupported_parameter")
    text = body.obj("text")
    structured = None
    if text is not None:
        unknown = sorted(set(text.data) - {"format", "verbosity"})
        if unknown:
            raise ApiError.invalid(text.name(unknown[0]), "unknown field",
                                   code="unsupported_parameter")
        structured = openai_structured(Fields({}), format_key="format", format_fields=text,
                                       flat=True)
    if body.string("truncation") not in (None, "disabled"):
        raise ApiError.invalid("truncation", "only 'disabled' is supported",
                               code="unsupported_parameter")
    body.boolean("parallel_tool_calls")
    tools = openai_tools(body, flat=True)
    choice = openai_tool_choice(body, tools)
    sampling: dict[str, Any] = {}
    reasoning = body.obj("reasoning")
    thinking = False  # no `reasoning`: no thinking; `reasoning` without an effort: no budget
    if reasoning is not None:
        unknown = sorted(set(reasoning.data) - {"effort", "summary", "generate_summary"})
        if unknown:
            raise ApiError.invalid(reasoning.name(unknown[0]), "unknown field",
                                   code="unsupported_parameter")
        for key in ("summary", "generate_summary"):
            if reasoning.get(key) is not MISSING:
                raise ApiError.invalid(reasoning.name(key), "reasoning summaries are not "
                                       "generated (the reasoning item carries the whole "
                                       "reasoning text)", code="unsupported_parameter")
        thinking = reasoning_effort(reasoning, "effort", sampling, None) is not False
    copy_fields(body, sampling, Fields.number, ("temperature", "top_p"))
    copy_fields(body, sampling, Fields.integer, ("seed", "top_k"))
    names = {"max_new_tokens": "max_output_tokens", "prompt_token_ids": "input"}
    thinking = constrain(structured, choice, thinking, sampling, names, "reasoning")
    return GenerationRequest(
        api=Api.OPENAI, model=body.string("model"), messages=_messages(body),
        sampling=sampling, max_tokens=body.integer("max_output_tokens"),
        stream=bool(body.boolean("stream")), enable_thinking=thinking,
        tools=tools if choice.mode != "none" else None,
        parse_tools=bool(tools) and choice.mode != "none",
        forced_tools=choice if choice.forced else None,
        session=session_of(body, session_header), field_names=names,
        echoed={k: body.data.get(k) for k in ("instructions", "max_output_tokens", "metadata",
                                              "temperature", "top_p", "tool_choice", "tools",
                                              "reasoning")},
        **isolation(body))
