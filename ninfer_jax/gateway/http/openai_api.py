"""OpenAI-compatible answers: `chat.completion` / `text_completion` objects and their SSE chunks.

Owns the response schema of `/v1/chat/completions` and `/v1/completions`: ids, choices (one per
generation, indexed as OpenAI does: prompt i's j-th sample is `i * n + j`), finish reasons,
log-probs (`logprobs.py`), `echo`, usage with `prompt_tokens_details.cached_tokens` (a prompt
counted once however many samples it has; its cached tokens are the fewest any sample reused),
and the streaming order per choice (role chunk, separate `reasoning_content` and `content`
deltas, finish chunk), then an optional usage chunk and `[DONE]`. A failure after the stream
started is sent as an `{"error": ...}` event before `[DONE]`.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ninfer_jax.engine import Delta, Finished, FinishReason, GenerationStart
from ninfer_jax.engine.events import Channel, GenerationResult, Usage
from ninfer_jax.frontend import tool_calls
from ninfer_jax.gateway.http import logprobs as lp
from ninfer_jax.gateway.http.choices import close_all, merged_events, start_choices, whole_results
from ninfer_jax.gateway.http.errors import Api, ApiError, from_failure
from ninfer_jax.gateway.http.generation import EventStream, Generation, prepare
from ninfer_jax.gateway.http.requests import GenerationRequest
from ninfer_jax.gateway.http.state import ServerState

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def usage_body(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens}}


def total_usage(usages: Sequence[Usage], n: int) -> Usage:
    """The answer's usage from its choices' (n samples per prompt, prompts in order)."""
    per_prompt = [usages[i: i + n] for i in range(0, len(usages), n)]
    return Usage(prompt_tokens=sum(u[0].prompt_tokens for u in per_prompt),
                 completion_tokens=sum(u.completion_tokens for u in usages),
                 cached_tokens=sum(min(x.cached_tokens for x in u) for u in per_prompt),
                 reasoning_tokens=sum(u.reasoning_tokens for u in usages))


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


class _Answer:
    """The fixed fields of one answer (id, created, model) for either endpoint."""

    def __init__(self, state: ServerState, req: GenerationRequest, chat: bool):
        self.chat, self.req = chat, req
        self.tokenizer = state.engine.frontend.tokenizer
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created, self.model = int(time.time()), state.model_name
        self.object = "chat.completion" if chat else "text_completion"
        self.wants_logprobs = req.sampling.get("logprobs") is not None

    def head(self, chunk: bool) -> dict[str, Any]:
        obj = f"{self.object}.chunk" if chunk and self.chat else self.object
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, index: int, result: GenerationResult,
               echo: tuple[str, dict[str, Any] | None] | None = None) -> dict[str, Any]:
        finish = _FINISH[result.finish_reason]
        if self.chat:
            content, calls = result.text, []
            if self.req.parse_tools:
                content, calls = tool_calls.parse(result.text, self.req.tools)
            message: dict[str, Any] = {"role": "assistant",
                                       "content": content if content or not calls else None}
            if calls:
                message["tool_calls"] = [call_body(c) for c in calls]
                finish = "tool_calls" if finish == "stop" else finish
            if result.reasoning_text:
                message["reasoning_content"] = result.reasoning_text
            logprobs = None
            if self.wants_logprobs:
                logprobs = {"content": lp.chat_content(self.tokenizer, result.logprobs or ()),
                            "refusal": None}
            return {"index": index, "message": message, "logprobs": logprobs,
                    "finish_reason": finish}
        text, logprobs = result.reasoning_text + result.text, None
        if self.wants_logprobs or echo is not None:
            builder = lp.CompletionLogprobs(self.tokenizer, len(echo[0]) if echo else 0)
            generated = builder.generated(result.logprobs or ()) if self.wants_logprobs else None
            if echo is not None and echo[1] is not None:
                generated = lp.merge(echo[1], generated)
            logprobs = generated
        if echo is not None:
            text = echo[0] + text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def chunk(self, index: int, text: str, channel: Channel | None, finish: str | None,
              usage: dict[str, Any] | None, logprobs: Any = None,
              builder: lp.CompletionLogprobs | None = None,
              delta: dict[str, Any] | None = None) -> str:
        if self.chat:
            if delta is not None:
                pass
            elif channel is None:
                delta = {"role": "assistant", "content": ""} if finish is None else {}
            else:
                key = "reasoning_content" if channel is Channel.THINKING else "content"
                delta = {key: text}
            rendered = None if logprobs is None else {
                "content": lp.chat_content(self.tokenizer, logprobs), "refusal": None}
            choice = {"index": index, "delta": delta, "logprobs": rendered,
                      "finish_reason": finish}
        else:
            rendered = None if logprobs is None else builder.generated(logprobs)
            choice = {"index": index, "text": text, "logprobs": rendered,
                      "finish_reason": finish}
        body = {**self.head(True), "choices": [choice]}
        if self.req.include_usage or usage is not None:
            body["usage"] = usage
        return _sse(body)


def call_body(call: tool_calls.ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments_json}}


class _ChoiceStream:
    """One streamed chat choice's content, through the tool-call parser when tools are on."""

    def __init__(self, answer: _Answer, index: int):
        self.answer, self.index = answer, index
        parse = answer.chat and answer.req.parse_tools
        self.parser = tool_calls.ToolCallStream(answer.req.tools) if parse else None
        self.num_calls = 0

    def content(self, text: str, usage: Any, logprobs: Any, final: bool = False) -> list[str]:
        """Chunks for content text (and log-probs that came with it)."""
        if self.parser is None:
            if not text and not logprobs:
                return []
            return [self.answer.chunk(self.index, text, Channel.CONTENT, None, usage, logprobs)]
        pieces = self.parser.finish() if final else self.parser.feed(text)
        out, carried = [], logprobs
        for piece in pieces:
            if isinstance(piece, str):
                out.append(self.answer.chunk(self.index, piece, Channel.CONTENT, None, usage,
                                             carried))
            else:
                first = {"index": self.num_calls, "id": piece.id, "type": "function",
                         "function": {"name": piece.name, "arguments": ""}}
                out.append(self.answer.chunk(self.index, "", None, None, usage, carried,
                                             delta={"tool_calls": [first]}))
                for arg in piece.argument_pieces():
                    out.append(self.answer.chunk(
                        self.index, "", None, None, usage, delta={"tool_calls": [
                            {"index": self.num_calls, "function": {"arguments": arg}}]}))
                self.num_calls += 1
            carried = None
        if carried:  # log-probs of text the parser holds back for now
            out.append(self.answer.chunk(self.index, "", Channel.CONTENT, None, usage, carried))
        return out


async def _stream(state: ServerState, gens: list[Generation], req: GenerationRequest,
                  answer: _Answer) -> AsyncGenerator[str, None]:
    k = len(gens)
    generated, cached = [0] * k, [0] * k
    finished: list[Usage | None] = [None] * k
    builders = [lp.CompletionLogprobs(answer.tokenizer) for _ in gens]
    streams = [_ChoiceStream(answer, i) for i in range(k)]

    def so_far() -> dict[str, Any] | None:  # vLLM's continuous_usage_stats
        if not req.continuous_usage:
            return None
        return usage_body(total_usage([Usage(g.prompt_tokens, generated[i], cached[i])
                                       for i, g in enumerate(gens)], req.n))

    if answer.chat:
        for i in range(k):
            yield answer.chunk(i, "", None, None, so_far())
    async for i, event in merged_events(gens):
        if isinstance(event, GenerationStart):
            cached[i] = event.cached_tokens
        elif isinstance(event, Delta):
            generated[i] += len(event.token_ids)
            if answer.chat and event.channel is Channel.CONTENT:
                for chunk in streams[i].content(event.text, so_far(), event.logprobs):
                    yield chunk
            elif event.text or event.logprobs:
                channel = event.channel if event.text else Channel.CONTENT
                yield answer.chunk(i, event.text, channel, None, so_far(), event.logprobs,
                                   builders[i])
        elif isinstance(event, Finished):
            if event.finish_reason not in _FINISH:
                error = from_failure(event.error, state.engine_available)
                yield _sse(error.body(Api.OPENAI))
                break
            finished[i] = event.usage
            if answer.chat:
                for chunk in streams[i].content("", so_far(), None, final=True):
                    yield chunk
            finish = _FINISH[event.finish_reason]
            if streams[i].num_calls and finish == "stop":
                finish = "tool_calls"
            yield answer.chunk(i, "", None, finish, so_far())
    else:
        if req.include_usage:
            yield _sse({**answer.head(True), "choices": [],
                        "usage": usage_body(total_usage(finished, req.n))})
    yield "data: [DONE]\n\n"


async def _echo(state: ServerState, gen: Generation, req: GenerationRequest
                ) -> tuple[str, dict[str, Any] | None]:
    """(prompt text, its log-probs part or None) for `echo`."""
    tokenizer = state.engine.frontend.tokenizer
    text = gen.prompt_text if gen.prompt_text is not None else tokenizer.decode(gen.prompt_ids)
    n = req.sampling.get("logprobs")
    if n is None:
        return text, None
    if state.prompt_scorer is None:
        raise ApiError.invalid("echo", "prompt log-probs need the scoring path, which this "
                               "server was started without", code="unsupported_parameter")
    logprobs, tops = await anyio.to_thread.run_sync(state.prompt_scorer.score, gen.prompt_ids, n)
    return text, lp.CompletionLogprobs(tokenizer).part(gen.prompt_ids, logprobs, tops)


async def _echo_only(state: ServerState, req: GenerationRequest, answer: _Answer) -> Response:
    """`echo` with max_tokens 0: the prompts and their log-probs, nothing generated."""
    choices, usages = [], []
    for i, r in enumerate(_prompts(req)):
        prepared, _ = await state.off_loop(prepare, state.engine,
                                           dataclasses.replace(r, max_tokens=1),
                                           body_bytes=req.body_bytes)
        gen = Generation(None, prepared.num_tokens, state.metrics, 0.0, req.api.value)
        gen.prompt_ids, gen.prompt_text = prepared.token_ids, prepared.text
        text, logprobs = await _echo(state, gen, req)
        for j in range(req.n):
            choices.append({"index": i * req.n + j, "text": text, "logprobs": logprobs,
                            "finish_reason": "length"})
            usages.append(Usage(prepared.num_tokens, 0))
    return JSONResponse({**answer.head(False), "choices": choices,
                         "usage": usage_body(total_usage(usages, req.n))})


def _prompts(req: GenerationRequest) -> list[GenerationRequest]:
    from ninfer_jax.gateway.http.choices import prompts
    return prompts(req)


async def complete(state: ServerState, request: Request, req: GenerationRequest,
                   received_at: float, *, chat: bool) -> Response:
    """Serves one chat or text completion (n choices per prompt), streaming or not."""
    answer = _Answer(state, req, chat)
    if req.echo and req.max_tokens == 0:
        return await _echo_only(state, req, answer)
    gens = await start_choices(state, req, received_at)
    if req.stream:
        return EventStream(_stream(state, gens, req, answer), close_all(gens))
    results = await whole_results(request, gens)
    if results is None:  # the client left; nobody reads this
        return Response(status_code=499)
    for result in results:
        if result.finish_reason not in _FINISH:
            return from_failure(result.error, state.engine_available).response(Api.OPENAI)
    choices, echoes = [], {}
    for index, (gen, result) in enumerate(zip(gens, results)):
        if req.echo and index // req.n not in echoes:  # once per prompt, not per sample
            echoes[index // req.n] = await _echo(state, gen, req)
        choices.append(answer.choice(index, result, echoes.get(index // req.n)))
    usage = total_usage([r.usage for r in results], req.n)
    return JSONResponse({**answer.head(False), "choices": choices, "usage": usage_body(usage)})
