"""Anthropic Messages answers: the `message` object and its SSE event sequence.

Owns the Messages response schema (content blocks `thinking`, `text`, then `tool_use` (parsed
out of the text when the request has tools), `stop_reason` end_turn/max_tokens/stop_sequence/
tool_use, usage with `cache_read_input_tokens`) and the streaming order:
`message_start`, then per block `content_block_start`, `content_block_delta`...,
`content_block_stop`, then `message_delta` (stop reason, final usage) and `message_stop`.
A failure after the stream started is an `error` event.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ninfer_jax.engine import Delta, Finished, FinishReason
from ninfer_jax.engine.events import Channel, Usage
from ninfer_jax.frontend import tool_calls
from ninfer_jax.gateway.http.errors import Api, from_failure
from ninfer_jax.gateway.http.generation import EventStream, Generation, start, whole_result
from ninfer_jax.gateway.http.requests import GenerationRequest
from ninfer_jax.gateway.http.state import ServerState

_STOP_REASON = {FinishReason.STOP: "end_turn", FinishReason.LENGTH: "max_tokens"}


def _stop(finish_reason: FinishReason, stop_string: str | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence): a matched stop string is "stop_sequence", EOS "end_turn"."""
    if finish_reason is FinishReason.STOP and stop_string is not None:
        return "stop_sequence", stop_string
    return _STOP_REASON[finish_reason], None


def _usage(usage: Usage | None, prompt_tokens: int) -> dict[str, Any]:
    if usage is None:
        return {"input_tokens": prompt_tokens, "output_tokens": 0,
                "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    return {"input_tokens": usage.prompt_tokens - usage.cached_tokens,
            "output_tokens": usage.completion_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cached_tokens}


def _shown(req: GenerationRequest, channel: Channel) -> bool:
    """Whether a channel's text is part of the answer: thinking only when the request asked
    for it (the prompt then closes the block, but a sampled answer may still open one)."""
    return channel is not Channel.THINKING or bool(req.enable_thinking)


def _event(name: str, body: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **body})}\n\n"


def _block(channel: Channel) -> tuple[dict[str, Any], str, str]:
    """(empty content block, delta type, delta field) for a channel."""
    if channel is Channel.THINKING:
        return {"type": "thinking", "thinking": "", "signature": ""}, "thinking_delta", "thinking"
    return {"type": "text", "text": ""}, "text_delta", "text"


def _message(state: ServerState, msg_id: str, content: list[dict[str, Any]],
             stop: tuple[str | None, str | None], usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": state.model_name,
            "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
            "usage": usage}


def _tool_use(call: tool_calls.ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"),
            "name": call.name, "input": call.arguments}


async def _stream(state: ServerState, gen: Generation, msg_id: str,
                  req: GenerationRequest) -> AsyncGenerator[str, None]:
    yield _event("message_start", {"message": _message(
        state, msg_id, [], (None, None), _usage(None, gen.prompt_tokens))})
    index, channel = -1, None  # channel: of the open block ("tool" for a tool_use block)
    parser = tool_calls.ToolCallStream(req.tools) if req.parse_tools else None
    used_tools = False

    def pieces(event_channel: Channel, text: str, final: bool = False) -> list:
        if event_channel is Channel.THINKING or parser is None:
            return [text] if text else []
        return parser.finish() if final else parser.feed(text)

    def blocks(event_channel: Channel, text: str, final: bool = False):
        nonlocal index, channel, used_tools
        for piece in pieces(event_channel, text, final):
            if isinstance(piece, str):
                block, delta_type, key = _block(event_channel)
                if event_channel is not channel:
                    if channel is not None:
                        yield _event("content_block_stop", {"index": index})
                    index, channel = index + 1, event_channel
                    yield _event("content_block_start", {"index": index, "content_block": block})
                yield _event("content_block_delta", {
                    "index": index, "delta": {"type": delta_type, key: piece}})
            else:
                if channel is not None:
                    yield _event("content_block_stop", {"index": index})
                index, channel, used_tools = index + 1, "tool", True
                yield _event("content_block_start", {
                    "index": index, "content_block": {**_tool_use(piece), "input": {}}})
                for arg in piece.argument_pieces():
                    yield _event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": arg}})

    async for event in gen.events():
        if isinstance(event, Delta) and event.text and _shown(req, event.channel):
            for chunk in blocks(event.channel, event.text):
                yield chunk
        elif isinstance(event, Finished):
            if event.finish_reason not in _STOP_REASON:
                error = from_failure(event.error, state.engine_available)
                yield _event("error", {"error": error.body(Api.ANTHROPIC)["error"]})
                return
            for chunk in blocks(Channel.CONTENT, "", final=True):
                yield chunk
            if channel is None:  # the answer is empty: still one (empty) text block
                index, channel = 0, Channel.CONTENT
                yield _event("content_block_start", {"index": 0,
                                                     "content_block": _block(channel)[0]})
            yield _event("content_block_stop", {"index": index})
            reason, sequence = _stop(event.finish_reason, event.stop_string)
            if used_tools and reason == "end_turn":
                reason = "tool_use"
            yield _event("message_delta", {
                "delta": {"stop_reason": reason, "stop_sequence": sequence},
                "usage": _usage(event.usage, gen.prompt_tokens)})
            yield _event("message_stop", {})


async def create_message(state: ServerState, request: Request, req: GenerationRequest,
                         received_at: float) -> Response:
    """Serves one `POST /v1/messages`, streaming or not."""
    gen = await start(state, req, received_at)
    msg_id = f"msg_{uuid.uuid4().hex}"
    if req.stream:
        return EventStream(_stream(state, gen, msg_id, req), gen.close)
    result = await whole_result(request, gen)
    if result is None:  # the client left; nobody reads this
        return Response(status_code=499)
    if result.finish_reason not in _STOP_REASON:
        return from_failure(result.error, state.engine_available).response(Api.ANTHROPIC)
    content = []
    if result.reasoning_text and _shown(req, Channel.THINKING):
        content.append({"type": "thinking", "thinking": result.reasoning_text, "signature": ""})
    text, calls = result.text, []
    if req.parse_tools:
        text, calls = tool_calls.parse(result.text, req.tools)
    if text or not calls:
        content.append({"type": "text", "text": text})
    content += [_tool_use(c) for c in calls]
    reason, sequence = _stop(result.finish_reason, result.stop_string)
    if calls and reason == "end_turn":
        reason = "tool_use"
    return JSONResponse(_message(state, msg_id, content, (reason, sequence),
                                 _usage(result.usage, gen.prompt_tokens)))
