"""`GenerationRequest`, the Engine's public input plus the transport choices (stream, usage
chunk) that every API's request parser produces, and what those parsers share.

Owns which fields each API accepts (`*_FIELDS`), the refusal of unsupported ones (naming the
field), and the readers the parsers share (OpenAI sampling fields onto SamplingParams, `n`,
stream options, sessions, content parts, structured output). The parsers are one module per
API: `openai_requests.py` (chat, completions), `anthropic_requests.py` (Messages),
`responses_requests.py` (Responses); each API's answers are rendered by its `*_api.py`. Nothing
here tokenizes or checks a limit that needs the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ninfer_jax.gateway.http.errors import Api, ApiError
from ninfer_jax.gateway.http.fields import Fields, check_text
from ninfer_jax.gateway.http.structured import thinking_off
from ninfer_jax.gateway.http.tools import (
    ToolChoice,
)

# OpenAI sampling fields read as numbers / integers (top_k, min_p, repetition_penalty are the
# common extensions of OpenAI-compatible servers).
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty")
# Fields every request may carry that change nothing here (so they are accepted, not refused):
# `user`/`metadata` (a session key and bookkeeping), `store` false, `service_tier`.
_SHARED = ("model", "stream", "cache_salt", "allow_control_tokens")
_OPENAI_SAMPLING = (*_FLOAT_FIELDS, "top_k", "seed", "stop", "min_tokens", "ignore_eos",
                    "stop_token_ids", "skip_special_tokens", "max_thinking_tokens",
                    "speculative")
CHAT_FIELDS = frozenset({
    *_SHARED, *_OPENAI_SAMPLING, "messages", "max_tokens", "max_completion_tokens", "n",
    "stream_options", "user", "metadata", "store", "service_tier", "logprobs", "top_logprobs",
    "prompt_cache_key", "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "logit_bias",
    "response_format", "enable_thinking", "chat_template_kwargs", "reasoning_effort",
    "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"})
COMPLETION_FIELDS = frozenset({
    *_SHARED, *_OPENAI_SAMPLING, "prompt", "max_tokens", "n", "best_of", "stream_options",
    "user", "metadata", "store", "service_tier", "logprobs", "echo", "suffix", "logit_bias",
    "prompt_cache_key", "enable_thinking", "response_format", "guided_json", "guided_regex", "guided_choice",
    "guided_grammar", "structured_outputs"})
MESSAGES_FIELDS = frozenset({
    *_SHARED, "messages", "system", "max_tokens", "temperature", "top_p", "top_k",
    "stop_sequences", "thinking", "metadata", "tools", "tool_choice", "service_tier"})
COUNT_TOKENS_FIELDS = frozenset({"model", "messages", "system", "thinking", "tools",
                                 "tool_choice", "max_tokens"})


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One request's public input. Exactly one of messages / prompt / prompt_token_ids is set.

    sampling: SamplingParams keyword arguments except `max_new_tokens`.
    max_tokens: the budget the client asked for (None: up to the context limit).
    field_names: SamplingParams / Engine field -> the name this API uses for it (for errors).
    """

    api: Api
    model: str | None
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_tokens: int | None = None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # every streamed chunk carries the usage so far
    echo: bool = False  # completions: the prompt (and its log-probs) before the answer
    n: int = 1  # choices per prompt (they share the prompt's prefill)
    more_prompts: tuple[Any, ...] = ()  # completions: the batch's other prompts (str or ids)
    tools: list[dict[str, Any]] | None = None  # rendered into the prompt by the template
    forced_tools: ToolChoice | None = None  # tool_choice required / named: calls only
    parse_tools: bool = False  # the answer's tool calls are parsed out of its content
    echoed: dict[str, Any] = dataclasses.field(default_factory=dict)  # Responses API: fields
    #   its response object repeats (instructions, tools, metadata, ...)
    enable_thinking: bool | None = None
    session: str | None = None
    cache_salt: str | None = None  # prefix reuse only among requests with the same salt
    allow_control_tokens: bool | None = None  # None: messages' text stays text, a prompt's not
    tenant: str | None = None  # set by the server from the API key that authorized the request
    body_bytes: int = 0  # the request body's size (set by the server: picks its work lane)
    field_names: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def prompt_field(self) -> str:
        return "prompt" if self.messages is None else "messages"

    @property
    def cache_scope(self) -> str | None:
        """The Engine's prefix-reuse scope: the tenant's key identity and the salt."""
        if self.tenant is None and self.cache_salt is None:
            return None
        return f"{self.tenant or ''}\0{self.cache_salt or ''}"


def isolation(body: Fields) -> dict[str, Any]:
    """The extension fields every API shares: `cache_salt` (vLLM's name) and
    `allow_control_tokens` (special-token text in messages becomes control tokens)."""
    salt = body.string("cache_salt")
    if salt is not None and not salt:
        raise ApiError.invalid("cache_salt", "must not be empty")
    return {"cache_salt": salt, "allow_control_tokens": body.boolean("allow_control_tokens")}


def reject_unknown(body: Fields, known: frozenset[str]) -> None:
    """An unknown field is refused (a client would otherwise believe it took effect)."""
    unknown = sorted(k for k in body.data if k not in known)
    if unknown:
        raise ApiError.invalid(unknown[0], "unknown field (not part of this API, or not "
                               "supported by this server)", code="unsupported_parameter")
    if body.data.get("store") not in (None, False):
        raise ApiError.invalid("store", "stored completions are not supported",
                               code="unsupported_parameter")


def refuse_unsupported(body: Fields, *, flags: tuple[str, ...] = (),
                        lists: tuple[str, ...] = ()) -> None:
    """Fields that would change the answer in ways not served yet: refused, never ignored."""
    for key in flags:
        if body.data.get(key) not in (None, False, 0):
            raise ApiError.invalid(key, "not supported yet", code="unsupported_parameter")
    for key in lists:
        if body.data.get(key) not in (None, [], {}):
            raise ApiError.invalid(key, "not supported yet", code="unsupported_parameter")




# OpenAI `reasoning_effort` (chat) / `reasoning.effort` (Responses) -> (thinking on, budget):
# "none" renders the prompt with thinking off; "low" and "medium" cap the thinking block at a
# budget of max_thinking_tokens (then the answer follows); "high" thinks without a budget.
REASONING_EFFORT: dict[str, tuple[bool, int | None]] = {
    "none": (False, None), "low": (True, 1024), "medium": (True, 4096), "high": (True, None)}


def reasoning_effort(body: Fields, key: str, sampling: dict[str, Any],
                     thinking: bool | None) -> bool | None:
    """Applies an effort field `key` of `body` (absent: `thinking` unchanged): returns whether
    to think and sets `sampling["max_thinking_tokens"]` for a budgeted effort. An unknown
    effort, or one contradicting an explicit enable_thinking / max_thinking_tokens, is a 400."""
    effort = body.string(key)
    if effort is None:
        return thinking
    if effort not in REASONING_EFFORT:
        raise ApiError.invalid(body.name(key), f"must be one of {list(REASONING_EFFORT)}, "
                               f"got {effort!r:.40}")
    on, budget = REASONING_EFFORT[effort]
    if thinking is not None and thinking != on:
        raise ApiError.invalid(body.name(key), f"{effort!r} contradicts enable_thinking="
                               f"{str(thinking).lower()}")
    if "max_thinking_tokens" in sampling:
        raise ApiError.invalid(body.name(key), "give either reasoning_effort or "
                               "max_thinking_tokens, not both")
    if budget is not None:
        sampling["max_thinking_tokens"] = budget
    return on


MAX_CHOICES = 16  # choices of one answer: n per prompt times the prompts of a batch


def num_choices(body: Fields, num_prompts: int = 1) -> int:
    """`n` (and `best_of`, which must equal it: no server-side ranking), within MAX_CHOICES."""
    n = body.integer("n")
    n = 1 if n is None else n
    if n < 1:
        raise ApiError.invalid("n", f"must be >= 1, got {n}")
    best_of = body.integer("best_of")
    if best_of is not None and best_of != n:
        raise ApiError.invalid("best_of", f"only best_of = n ({n}) is supported (no ranking of "
                               f"samples), got {best_of}", code="unsupported_parameter")
    if n * num_prompts > MAX_CHOICES:
        field = "n" if num_prompts == 1 else "prompt"
        raise ApiError.invalid(field, f"n ({n}) x prompts ({num_prompts}) = {n * num_prompts} "
                               f"choices; at most {MAX_CHOICES} per request")
    return n


def copy_fields(body: Fields, sampling: dict[str, Any], read, keys) -> None:
    """sampling[key] = read(body, key) for each of `keys` the body sets (`read`: a Fields
    reader such as Fields.number, which checks the type and names the field)."""
    for key in keys:
        value = read(body, key)
        if value is not None:
            sampling[key] = value


def openai_sampling(body: Fields) -> dict[str, Any]:
    sampling: dict[str, Any] = {}
    copy_fields(body, sampling, Fields.number, _FLOAT_FIELDS)
    copy_fields(body, sampling, Fields.integer, ("top_k", "seed", "max_thinking_tokens",
                                                 "min_tokens"))
    if sampling.get("top_k") == -1:
        sampling["top_k"] = 0  # -1 = off, as vLLM
    sampling["stop"] = body.stop("stop")
    copy_fields(body, sampling, Fields.boolean, ("ignore_eos", "skip_special_tokens"))
    speculative = body.boolean("speculative")  # an extension: false = this request drafts nothing
    if speculative is not None:
        sampling["speculative"] = "on" if speculative else "off"
    ids = body.array("stop_token_ids")
    if ids is not None:
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ApiError.invalid(f"stop_token_ids[{i}]", "expected a token id (integer)",
                                       code="invalid_type")
        sampling["stop_token_ids"] = tuple(ids)
    return sampling


def stream_options(body: Fields, stream: bool) -> dict[str, bool]:
    """`stream_options`: include_usage (a last chunk with the usage) and vLLM's
    continuous_usage_stats (the usage so far on every chunk)."""
    options = body.obj("stream_options")
    if options is None:
        return {"include_usage": False, "continuous_usage": False}
    unknown = sorted(set(options.data) - {"include_usage", "continuous_usage_stats"})
    if unknown:
        raise ApiError.invalid(options.name(unknown[0]), "unknown field",
                               code="unsupported_parameter")
    include = options.boolean("include_usage")
    continuous = options.boolean("continuous_usage_stats")
    if (include or continuous) and not stream:
        raise ApiError.invalid("stream_options", "only allowed when stream is true")
    return {"include_usage": bool(include), "continuous_usage": bool(continuous)}


def session_of(body: Fields, header: str | None, key: str = "user") -> str | None:
    """The session key: the `x-session-id` header, else OpenAI's `prompt_cache_key` (the SDKs
    send it to keep a conversation's prefix cached), else `key` (`user`)."""
    if header:
        return check_text(header, "x-session-id")
    if key == "user":
        cache_key = body.string("prompt_cache_key")
        if cache_key is not None:
            return cache_key
    return body.string(key)


def openai_content(m: Fields, role: str) -> str | list[dict[str, Any]]:
    """A chat message's content: a string, text parts (joined), or for a user message text and
    `image_url` parts ({"url": a data URL, file://... on a server started with
    --allowed_media_dir, http(s)://... with --media_fetch_timeout_s}), kept as parts for the
    Frontend, which fetches, decodes and checks the media (errors name the part)."""
    value = m.required("content")
    if role != "user" or not isinstance(value, list) or not any(
            isinstance(p, dict) and p.get("type") in ("image_url", "video", "video_url")
            for p in value):
        return m.text_content("content")
    parts: list[dict[str, Any]] = []
    for i, raw in enumerate(value):
        p = Fields(raw, f"{m.name('content')}[{i}]")
        kind = p.string("type", required=True)
        if kind == "text":
            parts.append({"type": "text", "text": p.string("text", required=True)})
        elif kind == "image_url":
            image = p.obj("image_url")
            if image is None:
                raise ApiError.invalid(p.name("image_url"), "must be an object {\"url\": ...}")
            parts.append({"type": "image_url", "image_url": _media_url(image)})
        elif kind == "video":  # frames: {"type": "video", "video": [url, ...], "fps": 2}
            frames = p.array("video", required=True)
            urls = [_media_url(Fields({"url": f}, f"{p.name('video')}[{j}]"))
                    for j, f in enumerate(frames)]
            fps = p.number("fps")
            parts.append({"type": "video", "video": urls, **({} if fps is None else
                                                                {"fps": fps})})
        elif kind == "video_url":  # a video file, sampled at `fps` (default 2) a second
            video = p.obj("video_url")
            if video is None:
                raise ApiError.invalid(p.name("video_url"), "must be an object {\"url\": ...}")
            fps = p.number("fps")
            parts.append({"type": "video", "video": _media_url(video),
                          **({} if fps is None else {"fps": fps})})
        else:
            raise ApiError.invalid(p.name("type"), f"only text, image_url and video parts are "
                                   f"supported, got {kind!r:.40}", code="unsupported_content")
    return parts


def _media_url(f: Fields) -> str:
    """An image URL the Frontend reads (data:, file://, http(s)://)."""
    url = f.string("url", required=True)
    if not url.startswith(("data:", "file://", "http://", "https://")):
        raise ApiError.invalid(f.name("url"), "must be a data URL (data:image/...;base64,...), "
                               "a file:// URL, or an http(s) URL on a server started with "
                               "--media_fetch_timeout_s", code="unsupported_content")
    return url


def constrain(structured, choice: ToolChoice, thinking: bool | None,
                 sampling: dict[str, Any], names: dict[str, str], thinking_field: str):
    """Adds a structured-output spec to `sampling` (and its field to `names`); a constrained
    request (a spec or a forced tool choice) runs with thinking off. Returns the thinking
    setting."""
    if structured is not None and choice.forced:
        raise ApiError.invalid(structured[1], "cannot be combined with tool_choice "
                               f"{choice.mode!r}")
    if structured is not None:
        sampling["structured"], names["structured"] = structured
    if structured is None and not choice.forced:
        return thinking
    thinking_off(thinking, thinking_field)
    if sampling.get("max_thinking_tokens") is not None:
        thinking_off(True, "max_thinking_tokens")
    return False
