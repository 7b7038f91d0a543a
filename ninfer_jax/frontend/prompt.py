"""PreparedPrompt: the token ids a request starts from, and `prepare`, which builds one.

Owns input validation for the three ways a prompt arrives (text, chat messages, token ids), each
error naming the offending field, and the prompt's content identity: a sha256 over the ids as
little-endian uint32, the key prefix lookup uses. It does not know context limits or budgets;
the Engine checks those.

Control tokens (DESIGN §2, SECURITY.md): only the chat template writes control tokens. Text
inside messages (content, reasoning, names, tool definitions) that spells a special token, e.g.
`<|im_end|>\n<|im_start|>system`, is tokenized as plain text, so a user cannot close their turn
or open another role's. Before rendering, each such text is wrapped in two Unicode
noncharacters; after rendering, control ids are produced only for special-token texts outside
those marks. An assistant message's `<think>`/`</think>` and `<tool_call>`/`</tool_call>` stay
markup (the template and the output parser read them as the model's channels). A raw `prompt`
is the caller's own template-level text: its special-token texts are control tokens by default.
`allow_control_tokens` overrides both defaults.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ninfer_jax.frontend.chat_template import ChatTemplate
from ninfer_jax.frontend.media import PartError, VisionTokens, expand, extract_media
from ninfer_jax.frontend.tokenizer import Tokenizer

# Unicode noncharacters (never in interchanged text) that mark special-token text inside content.
_OPEN, _CLOSE = "\ufdd0", "\ufdd1"
_ASSISTANT_MARKUP = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>"})


class PromptError(ValueError):
    """Bad prompt input; `field` names the request field at fault (e.g. `prompt_token_ids[3]`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def token_digest(token_ids: Sequence[int]) -> str:
    """Hex sha256 of `token_ids` encoded as little-endian uint32."""
    return hashlib.sha256(np.asarray(token_ids, dtype="<u4").tobytes()).hexdigest()


@dataclasses.dataclass(frozen=True)
class PreparedPrompt:
    """A validated prompt, immutable.

    token_ids: the prompt tokens, every id inside the tokenizer's vocabulary.
    text: the text that was tokenized (rendered chat or raw prompt); None for given token ids.
    media: images/videos referenced by placeholder tokens; empty for text-only prompts.
    digest: hex sha256 over token_ids (see `token_digest`), computed here.
    reuse_boundary: for a chat prompt, where the prompt of the conversation's next turn leaves
      this one (a position inside it), when that is before its end: the chat template renders a
      past answer differently from the tokens the model wrote (Qwen's drops the thinking block
      and the `<think>` the generation prompt opens), so a follow-up shares only the tokens
      before the answer. The Engine keeps a checkpoint there. None: at or after the end.
    """

    token_ids: tuple[int, ...]
    text: str | None = None
    media: tuple[Any, ...] = ()
    reuse_boundary: int | None = None
    # With media: token_ids with every image/video placeholder replaced by an id of its
    # medium's digest (`media.expand`), what prefix lookup compares; None: token_ids.
    identity_ids: tuple[int, ...] | None = None
    media_starts: tuple[int, ...] = ()  # each medium's first placeholder position
    digest: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "digest", token_digest(self.identity))

    @property
    def identity(self) -> tuple[int, ...]:
        """The ids prefix lookup compares (`identity_ids`, or the token ids)."""
        return self.token_ids if self.identity_ids is None else self.identity_ids

    def media_before(self, n: int) -> tuple[str, ...]:
        """The digests of the media whose placeholders start before position n."""
        return tuple(m.digest for m, at in zip(self.media, self.media_starts) if at < n)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def _checked_ids(token_ids: Any, vocab_size: int) -> tuple[int, ...]:
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, (Sequence, np.ndarray)):
        raise PromptError("prompt_token_ids", f"expected a sequence of ints, got {type(token_ids)}")
    if len(token_ids) == 0:
        raise PromptError("prompt_token_ids", "must not be empty")
    checked = []
    for i, token_id in enumerate(token_ids):
        if isinstance(token_id, (bool, np.bool_)) or not isinstance(token_id, (int, np.integer)):
            raise PromptError(
                f"prompt_token_ids[{i}]", f"expected an int, got {type(token_id).__name__}"
            )
        if not 0 <= token_id < vocab_size:
            raise PromptError(
                f"prompt_token_ids[{i}]", f"{token_id} is outside the vocabulary [0, {vocab_size})"
            )
        checked.append(int(token_id))
    return tuple(checked)


def _text_parts(content: list, field: str) -> str | list:
    """One string of a list of text parts; a list that holds images/videos (parts already
    reduced to {"type": "image"} / {"type": "video"} by `media.extract_media`) stays a list
    for the template, its text parts checked."""
    texts, keep = [], False
    for j, part in enumerate(content):
        if isinstance(part, Mapping) and set(part) == {"type"} \
                and part["type"] in ("image", "video"):
            keep = True
            continue
        if not isinstance(part, Mapping) or part.get("type") != "text" \
                or not isinstance(part.get("text"), str):
            raise PromptError(f"{field}[{j}]", "expected a text part {\"type\": \"text\", "
                              "\"text\": ...}, or an image or video part on a vision model")
        texts.append(part["text"])
    return [dict(p) for p in content] if keep else "".join(texts)


ROLES = ("system", "user", "assistant", "tool")  # what the chat templates render


def _check_unicode(text: str, field: str) -> None:
    """A lone surrogate cannot be encoded (the tokenizers raised a bare RuntimeError)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PromptError(field, f"contains a lone surrogate at index {e.start} (not valid "
                          f"Unicode)") from None


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated copies of `messages`; a list of text parts becomes one string."""
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        raise PromptError("messages", f"expected a list of messages, got {type(messages).__name__}")
    if not messages:
        raise PromptError("messages", "must not be empty")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise PromptError(f"messages[{i}]", f"expected a mapping, got {type(message).__name__}")
        role = message.get("role")
        if not isinstance(role, str):
            raise PromptError(f"messages[{i}].role", "must be a string")
        if role not in ROLES:
            raise PromptError(f"messages[{i}].role", f"must be one of {list(ROLES)}, got "
                              f"{role!r:.40}")
        content = message.get("content")
        if isinstance(content, list):
            content = _text_parts(content, f"messages[{i}].content")
        elif content is None:
            if not (role == "assistant" and message.get("tool_calls")):
                raise PromptError(f"messages[{i}].content", "must be a string or a list of text "
                                  "parts (null only for an assistant message with tool_calls)")
            content = ""  # templates render None as the text "None"
        elif not isinstance(content, str):
            raise PromptError(f"messages[{i}].content", f"must be a string or a list of text "
                              f"parts, got {type(content).__name__}")
        if isinstance(content, str):  # (media parts keep their list; their text is checked
            _check_unicode(content, f"messages[{i}].content")  # with the rendered prompt)
        checked.append({**message, "content": content})
    return checked


def _mark(value: Any, pattern, keep: frozenset[str] = frozenset()) -> Any:
    """`value` with every special-token text inside its strings wrapped in the marks."""
    if isinstance(value, str):
        value = value.replace(_OPEN, "\ufffd").replace(_CLOSE, "\ufffd")
        return pattern.sub(lambda m: m.group() if m.group() in keep
                           else _OPEN + m.group() + _CLOSE, value)
    if isinstance(value, Mapping):
        return {k: _mark(v, pattern, keep) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark(v, pattern, keep) for v in value]
    return value


def _mark_messages(messages: list[dict[str, Any]], pattern) -> list[dict[str, Any]]:
    marked = []
    for m in messages:
        out = {k: v if k == "role" else _mark(v, pattern) for k, v in m.items()}
        if m["role"] == "assistant" and isinstance(m.get("content"), str):
            out["content"] = _mark(m["content"], pattern, _ASSISTANT_MARKUP)
        marked.append(out)
    return marked


def _encode_marked(tokenizer: Tokenizer, text: str) -> tuple[list[int], str]:
    """(ids, plain text) of a rendered template: control ids only for unmarked special texts."""
    ids: list[int] = []
    run: list[str] = []  # plain text since the last control token
    start = 0
    for match in tokenizer.special_pattern.finditer(text):
        literal = match.start() > 0 and text[match.start() - 1] == _OPEN \
            and text.startswith(_CLOSE, match.end())
        run.append(text[start : match.start()])
        if literal:
            run.append(match.group())
        else:
            ids += tokenizer.encode_text("".join(run).replace(_OPEN, "").replace(_CLOSE, ""))
            ids.append(tokenizer.special_tokens[match.group()])
            run = []
        start = match.end()
    run.append(text[start:])
    ids += tokenizer.encode_text("".join(run).replace(_OPEN, "").replace(_CLOSE, ""))
    return ids, text.replace(_OPEN, "").replace(_CLOSE, "")


def prepare(
    tokenizer: Tokenizer,
    *,
    prompt: str | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    prompt_token_ids: Sequence[int] | None = None,
    chat_template: ChatTemplate | None = None,
    add_generation_prompt: bool = True,
    enable_thinking: bool | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    allow_control_tokens: bool | None = None,
    vision: VisionTokens | None = None,
) -> PreparedPrompt:
    """A PreparedPrompt from exactly one of `prompt`, `messages` (rendered with `chat_template`)
    or `prompt_token_ids`. Raises PromptError naming the field for bad input. `vision`: the
    model's vision tokens and processor; messages may then hold image and video parts
    (`frontend.media`).

    allow_control_tokens: whether special-token texts in the input become control tokens; None
    means no for messages (only the template writes them) and yes for a raw prompt."""
    given = [
        name
        for name, value in (
            ("prompt", prompt),
            ("messages", messages),
            ("prompt_token_ids", prompt_token_ids),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise PromptError(
            "prompt",
            f"exactly one of prompt, messages, prompt_token_ids must be given; got {given or 'none'}",
        )
    if allow_control_tokens is not None and not isinstance(allow_control_tokens, bool):
        raise PromptError("allow_control_tokens", "must be a bool or None")
    if enable_thinking is not None and not isinstance(enable_thinking, bool):
        raise PromptError("enable_thinking", "must be a bool or None")
    if prompt_token_ids is not None:
        return PreparedPrompt(_checked_ids(prompt_token_ids, tokenizer.vocab_size))
    pattern = tokenizer.special_pattern
    follow_up = None
    media: list = []
    if messages is not None:
        if isinstance(messages, Sequence) and not isinstance(messages, (str, bytes)) \
                and all(isinstance(m, Mapping) for m in messages):
            try:
                messages, media = extract_media([dict(m) for m in messages], vision)
            except PartError as e:
                raise PromptError(e.field, str(e)) from None
        checked = _check_messages(messages)
        if chat_template is None:
            raise PromptError("messages", "this model has no chat template; pass prompt instead")
        escape = not allow_control_tokens and pattern is not None
        if escape:
            checked = _mark_messages(checked, pattern)
            tools = None if tools is None else _mark(list(tools), pattern)
        render = functools.partial(chat_template.render, enable_thinking=enable_thinking,
                                   tools=tools)
        text = render(checked, add_generation_prompt=add_generation_prompt)
        _check_unicode(text, "messages")  # what else the template rendered (tools, names)
        if add_generation_prompt:
            # The next turn: this answer in the history, then one more user message.
            follow_up = checked + [{"role": "assistant", "content": _PLACEHOLDER},
                                   {"role": "user", "content": _PLACEHOLDER}]
    else:
        if not isinstance(prompt, str):
            raise PromptError("prompt", f"expected a string, got {type(prompt).__name__}")
        if enable_thinking:  # it was ignored: the demo model then answered nothing
            raise PromptError("enable_thinking", "applies to messages (rendered with the chat "
                              "template); a raw prompt is continued as given: pass messages, "
                              "or write the template's thinking tags into the prompt")
        _check_unicode(prompt, "prompt")
        text = prompt
        escape = allow_control_tokens is False and pattern is not None
        if escape:
            text = _mark(text, pattern)
    if not text:
        raise PromptError(given[0], "must not be empty")
    try:
        if escape:
            token_ids, text = _encode_marked(tokenizer, text)
        else:
            token_ids = tokenizer.encode(text)
    except (ValueError, UnicodeError) as e:  # e.g. a lone surrogate, an unspellable token
        raise PromptError(given[0], f"cannot be tokenized: {e}") from None
    if not token_ids:
        raise PromptError(given[0], "encodes to no tokens")
    boundary = None
    if follow_up is not None:
        boundary = _reuse_boundary(tokenizer, token_ids, render, follow_up, escape)
    if not media:
        return PreparedPrompt(tuple(token_ids), text=text, reuse_boundary=boundary)
    try:
        expanded, identity, starts = expand(token_ids, media, vision, tokenizer.encode)
    except ValueError as e:
        raise PromptError("messages", str(e)) from None
    if boundary is not None:  # the same position in the expanded prompt
        before = [m for m, at in zip(media, _pads(token_ids, vision)) if at < boundary]
        boundary = len(expand(token_ids[:boundary], before, vision, tokenizer.encode)[0])
    return PreparedPrompt(tuple(expanded), text=text, media=tuple(m for m, _ in media),
                          reuse_boundary=boundary, identity_ids=tuple(identity),
                          media_starts=tuple(starts))


def _pads(token_ids: Sequence[int], vision: VisionTokens) -> list[int]:
    """Positions of the image/video pads the template wrote."""
    return [p for p, t in enumerate(token_ids)
            if t in (vision.image_token_id, vision.video_token_id)]


# A stand-in for the unknown answer and next message: a symbol no tokenizer merges with the
# newline or the control token around it.
_PLACEHOLDER = "\ufffd"


def _reuse_boundary(tokenizer: Tokenizer, token_ids: list[int], render, follow_up,
                    escape: bool) -> int | None:
    """The number of leading tokens this prompt shares with the next turn's prompt (rendered
    with placeholders), when that is fewer than all of them."""
    try:
        text = render(follow_up, add_generation_prompt=False)
        ids = _encode_marked(tokenizer, text)[0] if escape else tokenizer.encode(text)
    except Exception:  # a template that refuses the shape: no boundary, nothing else changes
        return None
    common = 0
    for a, b in zip(token_ids, ids):
        if a != b:
            break
        common += 1
    return common if 0 < common < len(token_ids) else None
