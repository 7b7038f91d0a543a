"""Chat templates: the model's own Jinja template rendered the way HF `transformers` renders it.

Owns the Jinja environment (sandboxed, immutable, `trim_blocks`/`lstrip_blocks`, loop controls,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text) and where a template
lives in a model directory (`chat_template.jinja`, else `tokenizer_config.json`'s
`chat_template`). It produces prompt text only; tokenizing it is the tokenizer's job.
"""

from __future__ import annotations

import datetime
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


class ChatTemplateError(ValueError):
    """A template failed to compile or rejected the messages (its `raise_exception`)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """A compiled chat template; `special_tokens` (e.g. `bos_token`) are passed to every render."""

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e
        self.source = source
        self._special_tokens = dict(special_tokens or {})

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Prompt text for `messages`; `enable_thinking=None` leaves the template's default."""
        variables: dict[str, Any] = {**self._special_tokens, **kwargs}
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        try:
            return self._template.render(
                messages=list(messages),
                tools=list(tools) if tools is not None else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template rejected the messages: {e}") from e


def load_chat_template(directory: str | pathlib.Path) -> ChatTemplate | None:
    """The template of a model directory, or None when it has none."""
    directory = pathlib.Path(directory)
    config: dict[str, Any] = {}
    if (directory / TOKENIZER_CONFIG_FILE).is_file():
        config = json.loads((directory / TOKENIZER_CONFIG_FILE).read_text())
    special_tokens = {
        key: value if isinstance(value, str) else value["content"]
        for key in ("bos_token", "eos_token", "pad_token", "unk_token")
        if isinstance(value := config.get(key), (str, dict))
    }
    if (directory / TEMPLATE_FILE).is_file():
        return ChatTemplate((directory / TEMPLATE_FILE).read_text(), special_tokens)
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {entry["name"]: entry["template"] for entry in source}
        source = named.get("default")
    if not isinstance(source, str):
        return None
    return ChatTemplate(source, special_tokens)
