"""Turns the three request bodies (OpenAI chat and completions, Anthropic Messages) into one
`GenerationRequest`, the Engine's public input plus the transport choices (stream, usage chunk).

Owns which fields each API accepts, which it refuses as unsupported (naming the field), and the
mapping of API names onto SamplingParams (`max_tokens` -> `max_new_tokens`, `stop_sequences` ->
`stop`, ...). It does not tokenize, and it checks no limit that needs the model.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ninfer_jax.gateway.http.errors import Api, ApiError
from ninfer_jax.gateway.http.fields import Fields, check_text
from ninfer_jax.gateway.http.structured import openai_structured, thinking_off
from ninfer_jax.gateway.http.tools import (
    ToolChoice,
    anthropic_content,
    anthropic_tool_choice,
    anthropic_tools,
    openai_tool_calls,
    openai_tool_choice,
    openai_tools,
)

_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
               "assistant": "assistant", "tool": "tool"}
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


def _refuse_unsupported(body: Fields, *, flags: tuple[str, ...] = (),
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


def _n(body: Fields, num_prompts: int = 1) -> int:
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


def _openai_sampling(body: Fields) -> dict[str, Any]:
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


def _stream_options(body: Fields, stream: bool) -> dict[str, bool]:
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


def parse_chat(obj: Any, session_header: str | None) -> GenerationRequest:
    """`POST /v1/chat/completions`."""
    body = Fields(obj)
    reject_unknown(body, CHAT_FIELDS)
    if body.has("best_of"):
        raise ApiError.invalid("best_of", "is a completions field", code="unsupported_parameter")
    n = _n(body)
    _refuse_unsupported(body, lists=("functions", "logit_bias"))
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
    sampling = _openai_sampling(body)
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
        **_stream_options(body, stream), enable_thinking=thinking,
        session=session_of(body, session_header), field_names=names,
        **isolation(body))


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
    _refuse_unsupported(body, lists=("logit_bias",))
    if body.string("suffix"):
        raise ApiError.invalid("suffix", "not supported yet", code="unsupported_parameter")
    batch = _prompt_batch(body.required("prompt"))
    n = _n(body, len(batch))
    text, ids = (batch[0], None) if isinstance(batch[0], str) else (None, batch[0])
    stream = bool(body.boolean("stream"))
    sampling = _openai_sampling(body)
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
        **_stream_options(body, stream),
        enable_thinking=body.boolean("enable_thinking"), session=session_of(body, session_header),
        field_names=names, **isolation(body))


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
