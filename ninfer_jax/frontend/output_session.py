"""OutputSession: one request's output text, advanced only by committed previews.

Owns incremental detokenization (incomplete UTF-8 bytes are held until their character is
complete, so no delta ever carries half a character), the thinking/content channel split on
`<think>` / `</think>` (the markers themselves are never emitted, nor the newlines right after
`</think>`, which the template writes as a separator), EOS ids, and stop strings
matched across token boundaries (text that could still begin a stop string is held back until
resolved; a stop string is never emitted and ends the output). Stop strings apply to both
channels but never span a channel switch. Per request: `stop_token_ids` end the output like EOS,
`ignore_eos` drops the tokenizer's EOS ids from that set, `min_tokens` keeps every ending (EOS,
stop ids, stop strings) from taking effect before that many tokens (the Program also keeps the
ids from being sampled that early), and `skip_special_tokens` renders control tokens as no text
(channel markup, `<think>` and `<tool_call>` with their closing tags, is never skipped: the
channel split and the tool-call parser read it).

`preview(token_ids)` is a pure function of the committed state: it reports what the batch would
publish and how many of its tokens the Engine should accept; `commit(preview)` makes it so (DESIGN
§6: the Engine commits Program state first, then the preview). An uncommitted preview changes
nothing. The session does not own the generation budget: the Engine says when it ends.

Thinking budget (`max_thinking_tokens`): the session counts the tokens of the thinking channel.
When a batch leaves it open with the budget spent, the preview asks for forced control
(`Preview.control`: the canonical end of the block, `\n</think>\n\n`), which the Engine
commits without sampling (DESIGN §3 ControlReady) and previews with `forced=`; forced tokens
are canonical text, never matched against EOS ids or stop strings. `tokens_before_control()`
says how many tokens a round may propose before that point, so no round overshoots it.
"""

from __future__ import annotations

import codecs
import dataclasses
import enum
from collections.abc import Sequence

from ninfer_jax.frontend.tokenizer import Tokenizer


class Channel(enum.Enum):
    CONTENT = "content"
    THINKING = "thinking"


class FinishReason(enum.Enum):
    STOP = "stop"  # an EOS id or a stop string
    LENGTH = "length"  # the Engine's generation budget ended


@dataclasses.dataclass(frozen=True)
class TextDelta:
    channel: Channel
    text: str


@dataclasses.dataclass(frozen=True)
class _TextState:
    """Everything a preview reads and a commit replaces."""

    channel: Channel
    pending_bytes: bytes  # the start of a UTF-8 character whose remaining bytes are not yet seen
    held_text: str  # decoded text withheld because it could begin a stop string
    finish_reason: FinishReason | None = None
    after_think: bool = False  # `</think>` was the last thing: its newlines are dropped
    thinking_tokens: int = 0  # tokens committed to the thinking channel (markers excluded)


@dataclasses.dataclass(frozen=True)
class Preview:
    """What committing a batch would do.

    token_ids: the accepted prefix of the batch (the Engine commits exactly these to Program).
    deltas: text to publish, in order, consecutive same-channel text merged, never empty text.
    finish_reason: set when this batch ends the output.
    stop_string / eos_id: what ended it, when a stop string or an EOS id did.
    control: tokens the Frontend asks the Engine to force next (empty: none).
    """

    token_ids: tuple[int, ...]
    deltas: tuple[TextDelta, ...]
    finish_reason: FinishReason | None
    stop_string: str | None
    eos_id: int | None
    control: tuple[int, ...]
    _base: _TextState
    _after: _TextState

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids)


def _decode_step(pending: bytes, new: bytes, final: bool) -> tuple[str, bytes]:
    """Text completed by `new` after `pending`, and the bytes still waiting for a character."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.setstate((pending, 0))
    text = decoder.decode(new, final)
    return text, decoder.getstate()[0]


def _split_at_stop(text: str, stops: Sequence[str]) -> tuple[str, str, str | None]:
    """(text to emit, text to hold, matched stop string) for `text` after the held text.

    On a match, everything before the stop string that ends first (the longest of those ending
    together) is emitted and the rest dropped; choosing by end makes the result independent of
    how the text was split into tokens. Otherwise the longest suffix that is a proper prefix of
    some stop string is held.
    """
    match: tuple[int, str] | None = None  # (start, stop string)
    for stop in stops:
        at = text.find(stop)
        if at < 0:
            continue
        if match is None or (at + len(stop), -at) < (match[0] + len(match[1]), -match[0]):
            match = (at, stop)
    if match is not None:
        return text[: match[0]], "", match[1]
    hold = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:size]):
                hold = size
                break
    return text[: len(text) - hold], text[len(text) - hold :], None


def initial_channel(prompt_token_ids: Sequence[int], tokenizer: Tokenizer) -> Channel:
    """THINKING when the prompt leaves a `<think>` block open (templates open it), else CONTENT."""
    if tokenizer.think_ids is None:
        return Channel.CONTENT
    start, end = tokenizer.think_ids
    for token_id in reversed(prompt_token_ids):
        if token_id == start:
            return Channel.THINKING
        if token_id == end:
            return Channel.CONTENT
    return Channel.CONTENT


# Special tokens that are channel or tool-call markup: rendered (or read) even when skipping.
MARKUP_TOKENS = frozenset({"<think>", "</think>", "<tool_call>", "</tool_call>"})


def ending_ids(tokenizer: Tokenizer, stop_token_ids: Sequence[int] = (),
               ignore_eos: bool = False) -> frozenset[int]:
    """The ids that end a request's output: EOS (unless `ignore_eos`) and its stop ids."""
    eos = frozenset() if ignore_eos else tokenizer.eos_ids
    return eos | frozenset(int(t) for t in stop_token_ids)


class OutputSession:
    """Per-request output state; not thread-safe (the Engine worker alone drives it)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        channel: Channel = Channel.CONTENT,
        ignore_eos: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = False,
        max_thinking_tokens: int | None = None,
    ) -> None:
        for i, stop_string in enumerate(stop):
            if not isinstance(stop_string, str) or not stop_string:
                raise ValueError(f"stop[{i}]: must be a non-empty string")
        for token_id in stop_token_ids:
            tokenizer.check_id(token_id)
        self._tokenizer = tokenizer
        self._stops = tuple(stop)
        self._eos_ids = ending_ids(tokenizer, stop_token_ids, ignore_eos)
        self._min_tokens = int(min_tokens)
        markup = {tokenizer.special_id(t) for t in MARKUP_TOKENS} - {None}
        self._skipped = frozenset(tokenizer.special_tokens.values()) - markup \
            if skip_special_tokens else frozenset()
        self._think_ids = tokenizer.think_ids
        # The budget applies only where there is a thinking channel to close.
        self._thinking_budget = max_thinking_tokens if self._think_ids is not None else None
        self._thinking_end = (tuple(tokenizer.encode("\n")) + (self._think_ids[1],)
                              + tuple(tokenizer.encode("\n\n"))) if self._think_ids else ()
        self._state = _TextState(channel=channel, pending_bytes=b"", held_text="")
        self._chunks: dict[Channel, list[str]] = {Channel.CONTENT: [], Channel.THINKING: []}
        self._token_ids: list[int] = []

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._state.finish_reason

    @property
    def channel(self) -> Channel:
        """The channel the next token's text goes to."""
        return self._state.channel

    @property
    def text(self) -> str:
        """Committed content-channel text."""
        return "".join(self._chunks[Channel.CONTENT])

    @property
    def reasoning_text(self) -> str:
        """Committed thinking-channel text."""
        return "".join(self._chunks[Channel.THINKING])

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every committed output token id, EOS included."""
        return tuple(self._token_ids)

    @property
    def thinking_tokens(self) -> int:
        """Committed tokens of the thinking channel (the `<think>` markers not counted)."""
        return self._state.thinking_tokens

    def tokens_before_control(self, after: Preview | None = None) -> int | None:
        """How many tokens the next batch may hold before the session asks for forced control
        (the thinking budget's remainder while the thinking channel is open), or None. `after`:
        a preview of this session not committed yet (the Engine publishes a round while the
        next one runs), counted as if it were."""
        s = self._state if after is None else after._after
        if self._thinking_budget is None or s.channel is not Channel.THINKING:
            return None
        return max(self._thinking_budget - s.thinking_tokens, 0)

    def preview(self, token_ids: Sequence[int], *, budget_ends: bool = False,
                forced: int = 0) -> Preview:
        """What `token_ids` (the next produced tokens) would publish; changes nothing.

        `budget_ends` says the generation budget ends with this batch: unless an EOS id or stop
        string ends it first, the output finishes with LENGTH and all held text is released.
        `forced`: the first `forced` tokens were forced control (canonical: they switch
        channels and add text, but are not matched against EOS ids or stop strings).
        """
        base = self._state
        if base.finish_reason is not None:
            raise ValueError(f"the output already finished ({base.finish_reason.value})")
        deltas: list[TextDelta] = []
        channel, pending, held = base.channel, base.pending_bytes, base.held_text
        after_think = base.after_think

        def emit(text: str) -> None:
            if not text:
                return
            if deltas and deltas[-1].channel == channel:
                deltas[-1] = TextDelta(channel, deltas[-1].text + text)
            else:
                deltas.append(TextDelta(channel, text))

        def flush() -> None:
            nonlocal pending, held
            emit(held + _decode_step(pending, b"", final=True)[0])
            pending, held = b"", ""

        finish: FinishReason | None = None
        stop_string: str | None = None
        eos_id: int | None = None
        accepted = 0
        thinking = base.thinking_tokens
        for i, token_id in enumerate(token_ids):
            self._tokenizer.check_id(token_id)
            accepted += 1
            is_forced = i < forced  # canonical control text: no EOS or stop-string matching
            is_marker = self._think_ids is not None and token_id in self._think_ids
            if channel is Channel.THINKING and not is_marker and not is_forced:
                thinking += 1
            may_end = not is_forced and len(self._token_ids) + accepted >= self._min_tokens
            if token_id in self._eos_ids and may_end:
                flush()
                finish, eos_id = FinishReason.STOP, int(token_id)
                break
            if self._think_ids is not None and token_id in self._think_ids:
                flush()
                is_start = token_id == self._think_ids[0]
                channel = Channel.THINKING if is_start else Channel.CONTENT
                after_think = not is_start
                continue
            if token_id in self._skipped:
                continue
            text, pending = _decode_step(pending, self._tokenizer.token_bytes(token_id), False)
            if after_think:  # the template's "</think>\n\n" separator is not content
                text = text.lstrip("\n")
                after_think = not text
            if not text:
                continue
            if is_forced:  # no stop string completes across forced text
                emit(held + text)
                held = ""
                continue
            emitted, held, stop_string = _split_at_stop(held + text,
                                                        self._stops if may_end else ())
            emit(emitted)
            if stop_string is not None:
                finish, pending = FinishReason.STOP, b""
                break
        if finish is None and budget_ends:
            flush()
            finish = FinishReason.LENGTH
        control: tuple[int, ...] = ()
        if (finish is None and self._thinking_budget is not None
                and channel is Channel.THINKING and thinking >= self._thinking_budget):
            control = self._thinking_end
        return Preview(
            token_ids=tuple(int(t) for t in token_ids[:accepted]),
            deltas=tuple(deltas),
            finish_reason=finish,
            stop_string=stop_string,
            eos_id=eos_id,
            control=control,
            _base=base,
            _after=_TextState(channel, pending, held, finish, after_think, thinking),
        )

    def commit(self, preview: Preview) -> None:
        """Advances the session by `preview`, which must have been made from the current state."""
        if preview._base is not self._state:
            raise ValueError("stale preview: the session advanced after this preview was made")
        self._state = preview._after
        self._token_ids.extend(preview.token_ids)
        for delta in preview.deltas:
            self._chunks[delta.channel].append(delta.text)
