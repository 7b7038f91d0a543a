"""Structured-output fields of the OpenAI-style APIs, read into one `StructuredOutput`.

Owns the request shapes: OpenAI `response_format` ({type: text | json_object | json_schema,
json_schema: {name, schema, strict, description}}), the Responses API's `text.format` (the same
with the json_schema fields flat), vLLM's `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar` and `structured_outputs: {json | json_object | regex | choice | grammar}`. At
most one of them per request; a second is a 400 naming it. Whether a spec compiles is checked
later against the tokenizer (`generation.prepare`), with the field named here.

Thinking: a constrained request runs with thinking off (the grammar constrains the answer from
its first token); one that asks for thinking too is refused.
"""

from __future__ import annotations

import json
from typing import Any

from ninfer_jax.gateway.http.errors import ApiError
from ninfer_jax.gateway.http.fields import Fields
from ninfer_jax.sampling_params import SamplingParamsError, StructuredOutput

_STRUCTURED_KEYS = {"json": "json_schema", "json_object": "json_object", "regex": "regex",
                    "choice": "choice", "grammar": "grammar"}


def _schema_text(value: Any, field: str) -> str:
    """A JSON schema given as an object (or, for the vLLM fields, as JSON text)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ApiError.invalid(field, f"is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ApiError.invalid(field, "must be a JSON schema object", code="invalid_type")
    return json.dumps(value)


def _spec(kind: str, value: Any, field: str) -> StructuredOutput:
    try:
        if kind == "json_schema":
            return StructuredOutput("json_schema", _schema_text(value, field))
        if kind == "json_object":
            if value not in (True, None):
                raise ApiError.invalid(field, "must be true")
            return StructuredOutput("json_object")
        if kind == "choice":
            if not isinstance(value, list):
                raise ApiError.invalid(field, "must be a list of strings", code="invalid_type")
            return StructuredOutput("choice", choices=tuple(value))
        if not isinstance(value, str):
            raise ApiError.invalid(field, "must be a string", code="invalid_type")
        return StructuredOutput(kind, value)
    except SamplingParamsError as e:
        raise ApiError.invalid(field, str(e).removeprefix("structured")) from None


def _format(fmt: Fields, field: str, flat: bool) -> tuple[StructuredOutput, str] | None:
    """`response_format` / `text.format`: None for plain text."""
    kind = fmt.string("type", required=True)
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object"), field
    if kind != "json_schema":
        raise ApiError.invalid(f"{field}.type", f"must be 'text', 'json_object' or "
                               f"'json_schema', got {kind!r:.40}")
    spec = fmt if flat else Fields(fmt.required("json_schema"), f"{field}.json_schema")
    spec.string("name")
    spec.string("description")
    spec.boolean("strict")  # always strict: the output follows the schema
    schema_field = spec.name("schema")
    return _spec("json_schema", spec.required("schema"), schema_field), schema_field


def openai_structured(body: Fields, *, format_key: str | None = "response_format",
                      format_fields: Fields | None = None,
                      flat: bool = False) -> tuple[StructuredOutput, str] | None:
    """(spec, the field that gave it) of an OpenAI-style body, or None when unconstrained."""
    found: list[tuple[StructuredOutput, str]] = []
    holder = format_fields if format_fields is not None else body
    key = format_key or "format"
    fmt = holder.obj(key)
    if fmt is not None:
        got = _format(fmt, holder.name(key), flat)
        if got is not None:
            found.append(got)
    kinds = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
             "guided_grammar": "grammar"}
    for name, kind in kinds.items():
        value = body.data.get(name)
        if value is not None:
            found.append((_spec(kind, value, name), name))
    so = body.obj("structured_outputs")
    if so is not None:
        keys = [k for k in so.data if so.data[k] is not None]
        unknown = [k for k in keys if k not in _STRUCTURED_KEYS]
        if unknown:
            raise ApiError.invalid(so.name(unknown[0]), f"unknown field; expected one of "
                                   f"{sorted(_STRUCTURED_KEYS)}", code="unsupported_parameter")
        if len(keys) != 1:
            raise ApiError.invalid("structured_outputs", f"needs exactly one of "
                                   f"{sorted(_STRUCTURED_KEYS)}")
        found.append((_spec(_STRUCTURED_KEYS[keys[0]], so.data[keys[0]], so.name(keys[0])),
                      so.name(keys[0])))
    if len(found) > 1:
        raise ApiError.invalid(found[1][1], f"only one structured-output constraint per "
                               f"request (already given: {found[0][1]})")
    return found[0] if found else None


def thinking_off(thinking: bool | None, field: str) -> bool:
    """The thinking setting of a constrained request: off; asking for it is a 400."""
    if thinking:
        raise ApiError.invalid(field, "structured output and forced tool calls run with "
                               "thinking off (the grammar constrains the answer from its "
                               "first token)", code="unsupported_parameter")
    return False
