"""Typed reads of a decoded JSON body; every refusal is a 400 naming the field (dotted path).

Owns the JSON-level checks the APIs share: the body is an object, a field has the right type,
numbers are finite and representable, strings are valid Unicode (no lone surrogates), text
content is a string or a list of text parts. Ranges of sampling values are SamplingParams' job.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ninfer_jax.gateway.http.errors import ApiError

MISSING = object()


def decode_json(raw: bytes) -> Any:
    """The body as JSON; invalid UTF-8, invalid JSON or absurd nesting is a 400 on `body`."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError too
        raise ApiError.invalid("body", f"not valid JSON: {type(e).__name__}: {e}",
                               code="invalid_json") from None


def check_text(value: str, field: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError.invalid(field, "contains a lone surrogate (not valid Unicode)") from None
    return value


def type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(value), type(value).__name__)


class Fields:
    """One JSON object and the path that reached it (`messages[2]`, or "" for the body)."""

    def __init__(self, obj: Any, path: str = ""):
        if not isinstance(obj, dict):
            raise ApiError.invalid(path or "body", f"expected an object, got {type_name(obj)}")
        self.data, self.path = obj, path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def get(self, key: str) -> Any:
        """The raw value, or MISSING when absent or null."""
        value = self.data.get(key)
        return MISSING if value is None else value

    def has(self, key: str) -> bool:
        return self.get(key) is not MISSING

    def _bad(self, key: str, want: str, value: Any) -> ApiError:
        return ApiError.invalid(self.name(key), f"expected {want}, got {type_name(value)}",
                                code="invalid_type")

    def required(self, key: str) -> Any:
        value = self.get(key)
        if value is MISSING:
            raise ApiError.invalid(self.name(key), "is required", code="missing_required")
        return value

    def string(self, key: str, *, required: bool = False) -> str | None:
        value = self.required(key) if required else self.get(key)
        if value is MISSING:
            return None
        if not isinstance(value, str):
            raise self._bad(key, "a string", value)
        return check_text(value, self.name(key))

    def boolean(self, key: str) -> bool | None:
        value = self.get(key)
        if value is MISSING:
            return None
        if not isinstance(value, bool):
            raise self._bad(key, "a boolean", value)
        return value

    def integer(self, key: str, *, required: bool = False) -> int | None:
        value = self.required(key) if required else self.get(key)
        if value is MISSING:
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            raise self._bad(key, "an integer", value)
        return value

    def number(self, key: str) -> float | None:
        value = self.get(key)
        if value is MISSING:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(key, "a number", value)
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if not math.isfinite(number):
            raise ApiError.invalid(self.name(key), f"must be a finite number, got {value!r:.40}")
        return number

    def obj(self, key: str) -> Fields | None:
        value = self.get(key)
        if value is MISSING:
            return None
        return Fields(value, self.name(key))

    def array(self, key: str, *, required: bool = False) -> list[Any] | None:
        value = self.required(key) if required else self.get(key)
        if value is MISSING:
            return None
        if not isinstance(value, list):
            raise self._bad(key, "an array", value)
        return value

    def stop(self, key: str) -> tuple[str, ...]:
        """A stop string or a list of them."""
        value = self.get(key)
        if value is MISSING:
            return ()
        if isinstance(value, str):
            return (check_text(value, self.name(key)),)
        if not isinstance(value, list):
            raise self._bad(key, "a string or an array of strings", value)
        out = []
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise self._bad(f"{key}[{i}]", "a string", item)
            out.append(check_text(item, f"{self.name(key)}[{i}]"))
        return tuple(out)

    def text_content(self, key: str, *, part_types: tuple[str, ...] = ("text",)) -> str:
        """A message's content: a string, or a list of text parts (joined)."""
        value = self.required(key)
        if isinstance(value, str):
            return check_text(value, self.name(key))
        if not isinstance(value, list):
            raise self._bad(key, "a string or an array of content parts", value)
        texts = []
        for i, part in enumerate(value):
            p = Fields(part, f"{self.name(key)}[{i}]")
            kind = p.string("type", required=True)
            if kind not in part_types:
                raise ApiError.invalid(p.name("type"), f"only text content is supported, "
                                       f"got {kind!r:.40}", code="unsupported_content")
            texts.append(p.string("text", required=True))
        return "".join(texts)
