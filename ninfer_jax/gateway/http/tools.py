"""Tools in requests: function definitions, `tool_choice`, and tool histories of both APIs.

Owns reading OpenAI `tools` / `tool_choice` / assistant `tool_calls` / `tool` messages and
Anthropic `tools` / `tool_choice` / `tool_use` / `tool_result` blocks into the one shape the
chat template renders (OpenAI's: `{"type": "function", "function": {name, description,
parameters}}`, assistant `tool_calls` with `arguments` as a mapping, `tool` messages), each
refusal naming the field. `tool_choice` none means the tools are neither shown to the model nor
parsed out of its answer; required and named choices (Anthropic `any` / `tool`) are enforced by
a grammar over the call format (`frontend.tool_calls.call_grammar`), with thinking off.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from ninfer_jax.frontend.tool_calls import history_arguments
from ninfer_jax.gateway.http.errors import ApiError
from ninfer_jax.gateway.http.fields import Fields


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "function"
    name: str | None = None  # the function of mode "function"

    @property
    def forced(self) -> bool:
        """The answer must be tool calls (enforced by a grammar over the call format)."""
        return self.mode in ("required", "function")


# OpenAI's and Anthropic's rule for function names (what the call format can carry)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _function(fields: Fields, name_key: str, schema_key: str,
              schema_required: bool = False) -> dict[str, Any]:
    name = fields.string(name_key, required=True)
    if not _NAME.fullmatch(name):
        raise ApiError.invalid(fields.name(name_key), f"must be 1-64 letters, digits, '_' or "
                               f"'-', got {name!r:.80}")
    fn: dict[str, Any] = {"name": name}
    description = fields.string("description")
    if description is not None:
        fn["description"] = description
    if schema_required:
        fields.required(schema_key)
    schema = fields.obj(schema_key)
    fn["parameters"] = ({"type": "object", "properties": {}} if schema is None
                        else _schema(schema.data, fields.name(schema_key)))
    return {"type": "function", "function": fn}


def _schema(schema: Any, field: str) -> dict[str, Any]:
    """A tool's parameters: a JSON Schema object that is valid against its metaschema."""
    import jsonschema

    if not isinstance(schema, dict):
        raise ApiError.invalid(field, "must be a JSON Schema object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        at = "".join(f"[{p!r}]" for p in e.absolute_path) or "the schema"
        raise ApiError.invalid(field, f"is not a valid JSON Schema at {at}: "
                               f"{e.message:.200}") from None
    return schema


def openai_tools(body: Fields, key: str = "tools", flat: bool = False) -> list[dict] | None:
    """OpenAI chat `tools` ({"type": "function", "function": {...}}), or with `flat` the
    Responses API's ({"type": "function", "name": ..., "parameters": ...})."""
    raw = body.array(key)
    if not raw:
        return None
    tools = []
    for i, item in enumerate(raw):
        t = Fields(item, f"{body.name(key)}[{i}]")
        kind = t.string("type", required=True)
        if kind != "function":
            raise ApiError.invalid(t.name("type"), f"only 'function' tools are supported, got "
                                   f"{kind!r:.40}", code="unsupported_parameter")
        tools.append(_function(t, "name", "parameters") if flat else
                     _function(Fields(t.required("function"), t.name("function")), "name",
                               "parameters"))
    _unique(tools, body.name(key))
    return tools


def anthropic_tools(body: Fields) -> list[dict] | None:
    raw = body.array("tools")
    if not raw:
        return None
    tools = []
    for i, item in enumerate(raw):
        t = Fields(item, f"tools[{i}]")
        kind = t.string("type")
        if kind not in (None, "custom"):
            raise ApiError.invalid(t.name("type"), f"only custom (function) tools are "
                                   f"supported, got {kind!r:.40}", code="unsupported_parameter")
        tools.append(_function(t, "name", "input_schema", schema_required=True))
    _unique(tools, "tools")
    return tools


def _unique(tools: list[dict], field: str) -> None:
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ApiError.invalid(field, "function names must be unique")


def openai_tool_choice(body: Fields, tools: list[dict] | None) -> ToolChoice:
    value = body.get("tool_choice")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise ApiError.invalid("tool_choice", f"must be 'none', 'auto', 'required' or a "
                                   f"function, got {value!r:.40}")
        choice = ToolChoice(value)
    elif isinstance(value, dict):
        c = Fields(value, "tool_choice")
        if c.string("type") not in ("function", None):
            raise ApiError.invalid("tool_choice.type", "must be 'function'")
        fn = c.obj("function")
        name = fn.string("name", required=True) if fn is not None else c.string("name",
                                                                               required=True)
        choice = ToolChoice("function", name)
    elif body.has("tool_choice"):
        raise ApiError.invalid("tool_choice", "expected a string or an object",
                               code="invalid_type")
    else:
        choice = ToolChoice("auto")
    return _checked(choice, tools)


def anthropic_tool_choice(body: Fields, tools: list[dict] | None) -> ToolChoice:
    c = body.obj("tool_choice")
    if c is None:
        return _checked(ToolChoice("auto"), tools)
    kind = c.string("type", required=True)
    modes = {"auto": "auto", "any": "required", "none": "none", "tool": "function"}
    if kind not in modes:
        raise ApiError.invalid("tool_choice.type", f"must be one of {sorted(modes)}, got "
                               f"{kind!r:.40}")
    name = c.string("name", required=True) if kind == "tool" else None
    return _checked(ToolChoice(modes[kind], name), tools)


def _checked(choice: ToolChoice, tools: list[dict] | None) -> ToolChoice:
    if choice.mode in ("required", "function"):
        if not tools:
            raise ApiError.invalid("tool_choice", f"{choice.mode!r} needs tools")
        if choice.name is not None and choice.name not in {t["function"]["name"] for t in tools}:
            raise ApiError.invalid("tool_choice", f"names no tool: {choice.name!r:.80}")
    return choice


def openai_tool_calls(m: Fields) -> list[dict[str, Any]] | None:
    """An assistant message's `tool_calls` in the template's shape (arguments as a mapping)."""
    raw = m.array("tool_calls")
    if not raw:
        return None
    calls = []
    for j, item in enumerate(raw):
        c = Fields(item, f"{m.name('tool_calls')}[{j}]")
        if c.string("type") not in (None, "function"):
            raise ApiError.invalid(c.name("type"), "must be 'function'")
        fn = Fields(c.required("function"), c.name("function"))
        try:
            arguments = history_arguments(fn.get("arguments") if fn.has("arguments") else "",
                                          fn.name("arguments"))
        except ValueError as e:
            field, message = str(e).split(": ", 1)
            raise ApiError.invalid(field, message) from None
        calls.append({"id": c.string("id") or f"call_{j}", "type": "function",
                      "function": {"name": fn.string("name", required=True),
                                   "arguments": arguments}})
    return calls


def anthropic_content(m: Fields, role: str) -> list[dict[str, Any]]:
    """One Anthropic message as template messages: text (and thinking) parts joined, `tool_use`
    blocks as assistant tool_calls, `tool_result` blocks as `tool` messages (which the template
    shows to the model as the user's turn)."""
    value = m.required("content")
    if isinstance(value, str):
        return [{"role": role, "content": m.string("content")}]
    if not isinstance(value, list):
        raise ApiError.invalid(m.name("content"), "expected a string or an array of content "
                               "blocks", code="invalid_type")
    texts, thinking, calls, results, images = [], [], [], [], []
    for i, raw in enumerate(value):
        b = Fields(raw, f"{m.name('content')}[{i}]")
        kind = b.string("type", required=True)
        if kind == "text":
            texts.append(b.string("text", required=True))
            images.append({"type": "text", "text": texts[-1]})
        elif kind == "image" and role == "user":
            source = b.obj("source")
            if source is None or source.string("type", required=True) != "base64":
                raise ApiError.invalid(b.name("source"), "an image block needs a base64 "
                                       "source (fetching URLs is off)",
                                       code="unsupported_content")
            media_type = source.string("media_type", required=True)
            data = source.string("data", required=True)
            images.append({"type": "image", "image": f"data:{media_type};base64,{data}"})
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            if kind == "thinking":  # the model's reasoning goes back into the template
                thinking.append(b.string("thinking", required=True))
        elif kind == "tool_use" and role == "assistant":
            input_ = b.get("input")
            if not isinstance(input_, dict):
                raise ApiError.invalid(b.name("input"), "must be an object")
            calls.append({"id": b.string("id", required=True), "type": "function",
                          "function": {"name": b.string("name", required=True),
                                       "arguments": input_}})
        elif kind == "tool_result" and role == "user":
            b.string("tool_use_id", required=True)
            content = b.get("content")
            text = "" if content is None or content == [] else b.text_content("content")
            if b.boolean("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "content": text,
                            "tool_call_id": b.string("tool_use_id")})
        else:
            raise ApiError.invalid(b.name("type"), f"{kind!r:.40} blocks are not supported in "
                                   f"a {role} message", code="unsupported_content")
    out: list[dict[str, Any]] = list(results)
    if any(p["type"] == "image" for p in images):  # text and images in order, for the Frontend
        return out + [{"role": role, "content": images}]
    if texts or calls or thinking or not results:
        message: dict[str, Any] = {"role": role, "content": "".join(texts)}
        if thinking:
            message["reasoning_content"] = "".join(thinking)
        if calls:
            message["tool_calls"] = calls
        out.append(message)
    return out
