"""OpenAI-compatible answers: `chat.completion` / `text_completion` objects and their SSE chunks.

Owns the response schema of `/v1/chat/completions` and `/v1/completions`: ids, finish reasons,
usage with `prompt_tokens_details.cached_tokens`, and the streaming order (role chunk, separate
`reasoning_content` and `content` deltas, finish chunk, optional usage chunk, `[DONE]`). A
failure after the stream started is sent as an `{"error": ...}` event before `[DONE]`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ninfer_jax.engine import Delta, Finished, FinishReason, GenerationStart
from ninfer_jax.engine.events import Channel, GenerationResult, Usage
from ninfer_jax.gateway.http.errors import Api, from_failure
from ninfer_jax.gateway.http.generation import EventStream, Generation, start, whole_result
from ninfer_jax.gateway.http.requests import GenerationRequest
from ninfer_jax.gateway.http.state import ServerState

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def usage_body(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


class _Answer:
    """The fixed fields of one answer (id, created, model) for either endpoint."""

    def __init__(self, state: ServerState, chat: bool):
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created, self.model = int(time.time()), state.model_name
        self.object = "chat.completion" if chat else "text_completion"

    def head(self, chunk: bool) -> dict[str, Any]:
        obj = f"{self.object}.chunk" if chunk and self.chat else self.object
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, result: GenerationResult) -> dict[str, Any]:
        finish = _FINISH[result.finish_reason]
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": result.text}
            if result.reasoning_text:
                message["reasoning_content"] = result.reasoning_text
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": result.reasoning_text + result.text, "logprobs": None,
                      "finish_reason": finish}
        return {**self.head(False), "choices": [choice], "usage": usage_body(result.usage)}

    def chunk(self, text: str, channel: Channel | None, finish: str | None,
              include_usage: bool, usage: dict[str, Any] | None = None) -> str:
        if self.chat:
            if channel is None:
                delta = {"role": "assistant", "content": ""} if finish is None else {}
            else:
                key = "reasoning_content" if channel is Channel.THINKING else "content"
                delta = {key: text}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        body = {**self.head(True), "choices": [choice]}
        if include_usage or usage is not None:
            body["usage"] = usage
        return _sse(body)


async def _stream(state: ServerState, gen: Generation, req: GenerationRequest,
                  answer: _Answer) -> AsyncGenerator[str, None]:
    usage = req.include_usage
    generated, cached = 0, 0

    def so_far() -> dict[str, Any] | None:  # vLLM's continuous_usage_stats
        if not req.continuous_usage:
            return None
        return usage_body(Usage(gen.prompt_tokens, generated, cached))

    if answer.chat:
        yield answer.chunk("", None, None, usage, so_far())
    async for event in gen.events():
        if isinstance(event, GenerationStart):
            cached = event.cached_tokens
        elif isinstance(event, Delta):
            generated += len(event.token_ids)
            if event.text:
                yield answer.chunk(event.text, event.channel, None, usage, so_far())
        elif isinstance(event, Finished):
            if event.finish_reason not in _FINISH:
                error = from_failure(event.error, state.engine_available)
                yield _sse(error.body(Api.OPENAI))
                break
            yield answer.chunk("", None, _FINISH[event.finish_reason], usage, so_far())
            if usage:
                yield _sse({**answer.head(True), "choices": [],
                            "usage": usage_body(event.usage)})
    yield "data: [DONE]\n\n"


async def complete(state: ServerState, request: Request, req: GenerationRequest,
                   received_at: float, *, chat: bool) -> Response:
    """Serves one chat or text completion, streaming or not."""
    gen = await start(state.engine, req, state.metrics, received_at)
    answer = _Answer(state, chat)
    if req.stream:
        return EventStream(_stream(state, gen, req, answer), gen.close)
    result = await whole_result(request, gen)
    if result is None:  # the client left; nobody reads this
        return Response(status_code=499)
    if result.finish_reason not in _FINISH:
        return from_failure(result.error, state.engine_available).response(Api.OPENAI)
    return JSONResponse(answer.whole(result))
