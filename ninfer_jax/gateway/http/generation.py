"""One HTTP generation request's life at the Engine: prepare, submit, observe, release.

Owns the connection-to-request coupling of DESIGN §8 from the gateway's side: a request is
released (`handle.release()`, which cancels it if still running) exactly when its HTTP exchange
ends, whether the answer was complete or the client went away; a client disconnect is watched
for while the Engine works, streaming or not. Also owns the per-request metrics observations.
Order, admission and resources stay with the Engine.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ninfer_jax.engine import Delta, Finished, GenerationStart, RejectedError
from ninfer_jax.engine.events import Event, GenerationResult
from ninfer_jax.frontend import ChatTemplateError, PromptError
from ninfer_jax.frontend.grammar import GrammarError
from ninfer_jax.frontend.tool_calls import call_grammar
from ninfer_jax.gateway.http.errors import Api, ApiError, from_rejected
from ninfer_jax.gateway.http.metrics import Metrics
from ninfer_jax.gateway.http.requests import GenerationRequest
from ninfer_jax.gateway.http.state import ServerState
from ninfer_jax.sampling_params import SamplingParams, SamplingParamsError, StructuredOutput

if TYPE_CHECKING:
    from ninfer_jax.api import Engine
    from ninfer_jax.frontend.prompt import PreparedPrompt

T = TypeVar("T")
_FIELD = re.compile(r"^([A-Za-z_]\w*)([\w.\[\]]*?)(?::\s*|\s+)(.*)$", re.DOTALL)


def _renamed(message: str, names: dict[str, str]) -> tuple[str, str]:
    """(API field path, rest of the message) for an Engine/Frontend error message that starts
    with its field path (`max_new_tokens must be ...`, `prompt_token_ids[3]: ...`)."""
    match = _FIELD.match(message)
    if match is None:
        return "body", message
    base, path, rest = match.groups()
    return names.get(base, base) + path, rest


class Generation:
    """A submitted request: its handle, its prompt size, and the timing of its tokens."""

    def __init__(self, handle: Any, prompt_tokens: int, metrics: Metrics, received_at: float,
                 api: str):
        self.handle, self.prompt_tokens, self.metrics = handle, prompt_tokens, metrics
        self.received_at, self.api = received_at, api
        self._last_token_at: float | None = None
        self._closed = False
        self.finished: Finished | None = None
        self.prompt_ids: tuple[int, ...] = ()
        self.prompt_text: str | None = None

    async def events(self) -> AsyncIterator[Event]:
        async for event in self.handle:
            self._observe(event)
            yield event

    async def result(self) -> GenerationResult:
        async for _ in self.events():
            pass
        return await self.handle.aresult()

    def _observe(self, event: Event) -> None:
        now = time.monotonic()
        m = self.metrics
        if isinstance(event, GenerationStart):
            m.prompt_tokens.inc(event.prompt_tokens)
        elif isinstance(event, Delta) and event.token_ids:
            n = len(event.token_ids)
            m.rate.add(n, now)
            if self._last_token_at is None:
                m.ttft.observe(now - self.received_at)
            else:
                m.itl.observe((now - self._last_token_at) / n)
            self._last_token_at = now
        elif isinstance(event, Finished):
            self.finished = event
            # Its capacity back before the answer's last bytes go out: a client that sends its
            # next request on seeing the end (the 200, `[DONE]`) is never refused for this one.
            self.handle.release()

    def close(self, disconnected: bool) -> None:
        """Ends the request's hold on the Engine (cancelling it if it still runs); once."""
        if self._closed:
            return
        self._closed = True
        if self.finished is not None:
            outcome = self.finished.finish_reason.value
        else:
            outcome = "disconnected" if disconnected else "abandoned"
            if disconnected:
                self.metrics.disconnects.inc()
        self.metrics.requests.labels(self.api, outcome).inc()
        self.handle.release()


def prepare(engine: Engine, req: GenerationRequest) -> tuple[PreparedPrompt, SamplingParams]:
    """(PreparedPrompt, SamplingParams) of a request: the prompt prepared (to learn its length
    for the default budget), the context checked. Bad input raises a 400 naming the field."""
    names = req.field_names
    try:
        prepared = engine.frontend.prepare(
            prompt=req.prompt, messages=req.messages, prompt_token_ids=req.prompt_token_ids,
            enable_thinking=req.enable_thinking, allow_control_tokens=req.allow_control_tokens,
            tools=req.tools)
    except PromptError as e:
        raise ApiError.invalid(*_renamed(str(e), names)) from None
    except ChatTemplateError as e:
        raise ApiError.invalid(req.prompt_field, str(e)) from None
    n = prepared.num_tokens
    budget = req.max_tokens
    if budget is None:  # OpenAI's default: whatever the context has left
        budget = max(1, engine.max_seq_len - n)
    _check_context(req, n, budget, engine.max_seq_len)
    fields = dict(req.sampling)
    if req.forced_tools is not None:
        fields["structured"] = StructuredOutput("grammar", call_grammar(
            req.tools, req.forced_tools.name, engine.frontend.tokenizer.special_tokens))
        names = {**names, "structured": "tool_choice"}
    try:
        sampling = SamplingParams(max_new_tokens=budget, **fields)
    except SamplingParamsError as e:
        raise ApiError.invalid(*_renamed(str(e), names)) from None
    if sampling.structured is not None:
        try:  # compiled once per spec (cached); the Engine opens its matcher at submit
            engine.frontend.grammar().compile(sampling.structured)
        except GrammarError as e:
            raise ApiError.invalid(names.get("structured", "structured"),
                                   f"does not compile: {e}") from None
    return prepared, sampling


async def submit(engine: Engine, req: GenerationRequest, prepared: PreparedPrompt,
                 sampling: SamplingParams, metrics: Metrics, received_at: float) -> Generation:
    """Submits a prepared request; a refusal maps to 400/429/503."""
    try:
        handle = await engine.asubmit(prepared=prepared, sampling=sampling,
                                      session=req.session, cache_salt=req.cache_scope)
    except RejectedError as e:
        raise from_rejected(e, prompt_field=req.prompt_field,
                            budget_field=req.field_names.get("max_new_tokens",
                                                             "max_tokens")) from None
    gen = Generation(handle, prepared.num_tokens, metrics, received_at, req.api.value)
    gen.prompt_ids, gen.prompt_text = prepared.token_ids, prepared.text
    return gen


async def start(state: ServerState, req: GenerationRequest, received_at: float) -> Generation:
    """Prepares (off the event loop) and submits one request (see `prepare` and `submit`)."""
    prepared, sampling = await state.off_loop(prepare, state.engine, req,
                                              body_bytes=req.body_bytes)
    return await submit(state.engine, req, prepared, sampling, state.metrics, received_at)


def _check_context(req: GenerationRequest, prompt_tokens: int, budget: int,
                   limit: int) -> None:
    """The context-overflow error in each API's own words, which client libraries match on
    (litellm's context-window handling reads OpenAI's "maximum context length")."""
    if budget < 1 or prompt_tokens + budget <= limit:
        return  # a bad budget is SamplingParams' error, named as its field
    field = req.prompt_field
    if req.api is Api.ANTHROPIC:
        if prompt_tokens >= limit:
            message = f"prompt is too long: {prompt_tokens} tokens > {limit - 1} maximum"
        else:
            field = "max_tokens"
            message = (f"input length and `max_tokens` exceed context limit: {prompt_tokens} + "
                       f"{budget} > {limit}, decrease input length or `max_tokens` and try again")
    elif req.max_tokens is None or prompt_tokens >= limit:
        message = (f"This model's maximum context length is {limit} tokens. However, your "
                   f"{field} resulted in {prompt_tokens} tokens. Please reduce the length of the "
                   f"{field}.")
    else:
        budget_field = field = req.field_names.get("max_new_tokens", "max_tokens")
        message = (f"This model's maximum context length is {limit} tokens. However, you "
                   f"requested {prompt_tokens + budget} tokens ({prompt_tokens} in the "
                   f"{req.prompt_field}, {budget} in the completion). Please reduce the length "
                   f"of the {req.prompt_field} or {budget_field}.")
    raise ApiError(400, message, param=field, code="context_length_exceeded")


async def whole_result(request: Request, gen: Generation) -> Any | None:
    """The finished result of a non-streaming request, or None when the client left first (the
    request is then cancelled at the Engine)."""
    result = None
    try:
        result = await until_disconnect(request, gen.result)
    finally:
        gen.close(result is None)
    return result


async def until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T | None:
    """Runs `work()` while watching the connection; None when the client left first."""
    result: list[T] = []
    async with anyio.create_task_group() as tg:
        async def run() -> None:
            result.append(await work())
            tg.cancel_scope.cancel()

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(run)
        tg.start_soon(watch)
    return result[0] if result else None


class EventStream(Response):
    """A Server-Sent Events response that stops as soon as the client disconnects and then
    calls `on_close(disconnected)` exactly once, whatever ended the stream."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncGenerator[str, None], on_close: Callable[[bool], None]):
        self.status_code, self.background = 200, None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.chunks, self.on_close = chunks, on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        disconnected = False

        async def stream(tg: anyio.abc.TaskGroup) -> None:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk.encode(),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            tg.cancel_scope.cancel()

        async def watch(tg: anyio.abc.TaskGroup) -> None:
            nonlocal disconnected
            while (await receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            tg.cancel_scope.cancel()

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream, tg)
                tg.start_soon(watch, tg)
        except* OSError:  # the transport broke while sending
            disconnected = True
        finally:
            self.on_close(disconnected)
            await self.chunks.aclose()
