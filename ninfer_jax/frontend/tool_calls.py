"""Tool calls in the Qwen3.6 chat template's format: parsing model output, preparing histories.

The template (`<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n...
</function>\\n</tool_call>`) is the model's own; this module owns reading it back out of the
content channel, whole (`parse`) or incrementally (`ToolCallStream`, which releases the text
before a call at once and each call when it closes), and turning parameter text into JSON
values by the tool's declared schema (a string parameter stays text; others are read as JSON
when they parse, as vLLM's qwen3-coder parser does). A call that does not follow the format is
not a call: its text is returned as content, never an error. It also owns the reverse step for
histories: OpenAI `arguments` (a JSON object in a string) become the mapping the template
iterates.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from ninfer_jax.frontend.grammar import NUMERIC_BOUNDS, bounded_integers

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"\A\s*<function=([^>\n]+)>\n?(.*?)</function>\s*\Z", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>\s*", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = dataclasses.field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)

    def argument_pieces(self) -> list[str]:
        """`arguments_json` in pieces, one per parameter (what a stream sends as deltas)."""
        if not self.arguments:
            return ["{}"]
        pieces = []
        for i, (k, v) in enumerate(self.arguments.items()):
            pieces.append(("{" if i == 0 else ", ") + json.dumps(k, ensure_ascii=False) + ": "
                          + json.dumps(v, ensure_ascii=False))
        pieces[-1] += "}"
        return pieces


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """name -> JSON schema `properties` of each function tool (OpenAI or flat shape)."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else {}
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") or fn.get("input_schema") or {}
            props = params.get("properties") if isinstance(params, Mapping) else None
            out[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


def _value(text: str, schema: Any) -> Any:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if kind == "string" or (isinstance(kind, list) and "string" in kind and len(kind) == 1):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_call(body: str, schemas: Mapping[str, Mapping[str, Any]]) -> ToolCall | None:
    """The call in the text between `<tool_call>` and `</tool_call>`, or None if malformed
    (unknown function names are calls too: the client decides)."""
    match = _CALL.match(body)
    if match is None:
        return None
    name, inner = match.group(1).strip(), match.group(2)
    props = schemas.get(name, {})
    args: dict[str, Any] = {}
    at = 0
    inner = inner.strip()
    for p in _PARAM.finditer(inner):
        if inner[at:p.start()].strip():
            return None
        args[p.group(1).strip()] = _value(p.group(2), props.get(p.group(1).strip()))
        at = p.end()
    if inner[at:].strip() or not name:
        return None
    return ToolCall(name, args)


def parse(text: str, tools: Sequence[Mapping[str, Any]] | None) -> tuple[str, list[ToolCall]]:
    """(content, calls) of a whole answer; malformed call text stays in the content."""
    stream = ToolCallStream(tools)
    pieces = stream.feed(text) + stream.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return content, [p for p in pieces if isinstance(p, ToolCall)]


class ToolCallStream:
    """Incremental parser over content text: `feed(text)` and `finish()` return what can be
    released, in order: text (str) and calls (ToolCall). Text that could begin `<tool_call>` is
    held until resolved; a call is released when its `</tool_call>` arrives (or as text, if
    malformed or unclosed at the end). Content after the calls is kept as text."""

    def __init__(self, tools: Sequence[Mapping[str, Any]] | None):
        self._schemas = tool_schemas(tools)
        self._buf = ""
        self._in_call = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[str | ToolCall]:
        self._buf += text
        out: list[str | ToolCall] = []
        while True:
            if not self._in_call:
                at = self._buf.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buf, OPEN)
                    head = self._buf[: len(self._buf) - keep]
                    keep += len(head) - len(head.rstrip("\n"))  # newlines may precede a call
                    if len(self._buf) > keep:
                        out.append(self._buf[: len(self._buf) - keep])
                        self._buf = self._buf[len(self._buf) - keep:]
                    return out
                before = self._buf[:at].rstrip("\n")
                if before.strip():  # whitespace before and between calls is dropped
                    out.append(before)
                self._buf, self._in_call = self._buf[at:], True
            end = self._buf.find(CLOSE)
            if end < 0:
                return [p for p in out if p != ""]
            raw = self._buf[: end + len(CLOSE)]
            call = parse_call(raw[len(OPEN): end], self._schemas)
            if call is None:
                out.append(raw)
            else:
                self.calls.append(call)
                out.append(call)
            self._buf, self._in_call = self._buf[end + len(CLOSE):], False
            if self.calls:
                self._buf = self._buf.lstrip("\n") if self._buf.strip() == "" else self._buf

    def finish(self) -> list[str | ToolCall]:
        """The rest at the end of the answer: held or unclosed text is content."""
        rest, self._buf, self._in_call = self._buf, "", False
        if self.calls and not rest.strip():
            return []
        return [rest] if rest else []


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `token`."""
    for size in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:size]):
            return size
    return 0


def history_arguments(arguments: Any, field: str) -> dict[str, Any]:
    """A history's tool-call arguments as the mapping the template iterates: a JSON object
    given as text (OpenAI) or as an object (Anthropic `input`). Raises ValueError naming
    `field` otherwise."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as e:
            raise ValueError(f"{field}: not valid JSON ({e})") from None
    if not isinstance(arguments, dict):
        raise ValueError(f"{field}: must be a JSON object")
    return arguments


def call_grammar(tools: Sequence[Mapping[str, Any]], name: str | None = None,
                 special_tokens: Mapping[str, int] | None = None) -> str:
    """A Lark grammar (llguidance's dialect) whose matches are answers of tool calls only, in
    the template's format: one call to function `name`, or with `name` None one or more calls
    to any of `tools` (tool_choice "required"). A call names each declared parameter in the
    schema's order, the required ones always; a string parameter's value is one line of text
    without '<', an enum's one of its values, any other's JSON matching its schema (`%json`).
    Markup the tokenizer holds as special tokens (`special_tokens`: text -> id) is written by
    id, so the model's own control token is the one allowed."""
    specials = special_tokens or {}

    def literal(text: str) -> str:
        parts, rest = [], text
        while rest:
            hits = [(rest.find(t), t) for t in (OPEN, CLOSE) if t in specials and t in rest]
            if not hits:
                parts.append(json.dumps(rest))
                break
            at, tag = min(hits)
            if at:
                parts.append(json.dumps(rest[:at]))
            parts.append(f"<[{specials[tag]}]>")
            rest = rest[at + len(tag):]
        return " ".join(parts)

    rules, functions = [], []
    for i, tool in enumerate(tools):
        fn = tool.get("function", tool)
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {}
        props = params.get("properties") or {}
        required = set(params.get("required") or ())
        body = []
        for j, (pname, schema) in enumerate(props.items()):
            rule = f"p{i}_{j}"
            rules.append(f"{rule}: {literal(f'<parameter={pname}>' + chr(10))} "
                         f"{_value_grammar(schema)} {literal(chr(10) + '</parameter>' + chr(10))}")
            body.append(rule if pname in required else f"{rule}?")
        rules.append(f"f{i}: {literal(OPEN + chr(10) + '<function=' + fn['name'] + '>' + chr(10))}"
                     f" {' '.join(body)} {literal('</function>' + chr(10) + CLOSE)}")
        functions.append(f"f{i}")
    if not functions:
        raise ValueError(f"no tool named {name!r}")
    call = " | ".join(functions)
    start = f"start: call ({literal(chr(10))} call)*" if name is None else "start: call"
    return "\n".join([start, f"call: {call}", *rules])


# A number parameter without constraints: at most 16 significant digits on each side of the
# point and a 3-digit exponent (a double's precision and range), so a written number ends.
_NUMBER = r"/-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][-+]?[0-9]{1,3})?/"


def _value_grammar(schema: Any) -> str:
    schema = schema if isinstance(schema, Mapping) else {}
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(json.dumps(v) for v in enum) + ")"
    if schema.get("type") == "string":
        return "/[^<\\n]+/"
    if schema.get("type") == "number" and not any(
            k in schema for k in (*NUMERIC_BOUNDS, "multipleOf", "enum", "const")):
        return _NUMBER
    return "%json" + json.dumps(bounded_integers(dict(schema)) or {})
