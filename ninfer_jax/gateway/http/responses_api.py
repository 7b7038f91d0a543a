"""The OpenAI Responses API (`POST /v1/responses`): text in, text and function calls out.

Owns the response object (the request is parsed by `responses_requests.py`): `output` items
`reasoning` (when the model thought), `message` (one `output_text` part) and `function_call`s,
`status` completed or incomplete (`max_output_tokens`), usage with cached and reasoning tokens.
Nothing is stored: `previous_response_id` and `store: true` are refused. Streaming follows the
API's event order: `response.created`, `response.in_progress`, then per item
`response.output_item.added`, its content events (`response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`; or
`response.reasoning_text.delta`/`.done`; or `response.function_call_arguments.delta`/`.done`),
`response.output_item.done`, and last `response.completed`; every event has a
`sequence_number`.
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
from ninfer_jax.engine.events import Channel
from ninfer_jax.frontend import tool_calls
from ninfer_jax.gateway.http.errors import Api, from_failure
from ninfer_jax.gateway.http.generation import EventStream, start, until_disconnect
from ninfer_jax.gateway.http.requests import (
    GenerationRequest,
)
from ninfer_jax.gateway.http.state import ServerState


class _Builder:
    """One response's object and its events."""

    def __init__(self, state: ServerState, req: GenerationRequest):
        body = req.echoed
        self.id = f"resp_{uuid.uuid4().hex}"
        self.req, self.seq = req, 0
        self.base = {
            "id": self.id, "object": "response", "created_at": int(time.time()),
            "model": state.model_name, "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": True,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "text": {"format": {"type": "text"}}, "truncation": "disabled", "store": False,
            "error": None, "incomplete_details": None, "reasoning": body.get("reasoning"),
        }

    def response(self, status: str, output: list, usage: dict | None,
                 finish: FinishReason | None = None) -> dict[str, Any]:
        out = {**self.base, "status": status, "output": output, "usage": usage}
        if finish is FinishReason.LENGTH:
            out["status"] = "incomplete"
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out

    def event(self, name: str, **body: Any) -> str:
        self.seq += 1
        data = {"type": name, "sequence_number": self.seq - 1, **body}
        return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def _usage(prompt: int, cached: int, output: int, reasoning: int) -> dict[str, Any]:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + output}


def _items(reasoning: str, text: str, calls: list[tool_calls.ToolCall],
           status: str = "completed") -> list[dict[str, Any]]:
    items = []
    if reasoning:
        items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": reasoning}],
                      "status": status})
    if text or not calls:
        items.append(_message_item(f"msg_{uuid.uuid4().hex}", text, status))
    items += [_call_item(c, status) for c in calls]
    return items


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [],
                                        "logprobs": []}]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": content}


def _call_item(call: tool_calls.ToolCall, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call.id.removeprefix('call_')}",
            "call_id": call.id, "name": call.name, "arguments": call.arguments_json,
            "status": status}


class _Tally:
    """What the events say: prompt tokens, cached tokens, output and reasoning token counts."""

    def __init__(self, gen: Any):
        self.prompt, self.cached, self.output, self.reasoning = gen.prompt_tokens, 0, 0, 0

    def add(self, event: Any) -> None:
        if isinstance(event, GenerationStart):
            self.cached = event.cached_tokens
        elif isinstance(event, Delta):
            self.output += len(event.token_ids)
            if event.channel is Channel.THINKING:
                self.reasoning += len(event.token_ids)

    def usage(self) -> dict[str, Any]:
        return _usage(self.prompt, self.cached, self.output, self.reasoning)


async def _stream(state: ServerState, gen: Any, b: _Builder) -> AsyncGenerator[str, None]:
    tally = _Tally(gen)
    yield b.event("response.created", response=b.response("in_progress", [], None))
    yield b.event("response.in_progress", response=b.response("in_progress", [], None))
    output: list[dict[str, Any]] = []
    parser = tool_calls.ToolCallStream(b.req.tools) if b.req.parse_tools else None
    open_item: dict[str, Any] | None = None  # the item being streamed, with its text so far

    def close():
        nonlocal open_item
        if open_item is None:
            return
        item, text = open_item["item"], open_item["text"]
        at = len(output)
        if item["type"] == "reasoning":
            yield b.event("response.reasoning_text.done", item_id=item["id"], output_index=at,
                          content_index=0, text=text)
            item = {**item, "status": "completed",
                    "content": [{"type": "reasoning_text", "text": text}]}
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            yield b.event("response.output_text.done", item_id=item["id"], output_index=at,
                          content_index=0, text=text, logprobs=[])
            yield b.event("response.content_part.done", item_id=item["id"], output_index=at,
                          content_index=0, part=part)
            item = {**item, "status": "completed", "content": [part]}
        yield b.event("response.output_item.done", output_index=at, item=item)
        output.append(item)
        open_item = None

    def text_events(kind: str, text: str):
        nonlocal open_item
        if open_item is not None and open_item["item"]["type"] != kind:
            yield from close()
        at = len(output)
        if open_item is None:
            if kind == "reasoning":
                item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                        "content": [], "status": "in_progress"}
                yield b.event("response.output_item.added", output_index=at, item=item)
            else:
                item = _message_item(f"msg_{uuid.uuid4().hex}", None, "in_progress")
                yield b.event("response.output_item.added", output_index=at, item=item)
                yield b.event("response.content_part.added", item_id=item["id"],
                              output_index=at, content_index=0,
                              part={"type": "output_text", "text": "", "annotations": [],
                                    "logprobs": []})
            open_item = {"item": item, "text": ""}
        open_item["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else \
            "response.output_text.delta"
        extra = {} if kind == "reasoning" else {"logprobs": []}
        yield b.event(name, item_id=open_item["item"]["id"], output_index=at, content_index=0,
                      delta=text, **extra)

    def call_events(call: tool_calls.ToolCall):
        yield from close()
        at = len(output)
        item = {**_call_item(call, "in_progress"), "arguments": ""}
        yield b.event("response.output_item.added", output_index=at, item=item)
        for piece in call.argument_pieces():
            yield b.event("response.function_call_arguments.delta", item_id=item["id"],
                          output_index=at, delta=piece)
        yield b.event("response.function_call_arguments.done", item_id=item["id"],
                      output_index=at, arguments=call.arguments_json)
        done = _call_item(call, "completed")
        yield b.event("response.output_item.done", output_index=at, item=done)
        output.append(done)

    def content_events(text: str, final: bool = False):
        pieces = ([text] if text else []) if parser is None else \
            (parser.finish() if final else parser.feed(text))
        for piece in pieces:
            if isinstance(piece, str):
                yield from text_events("message", piece)
            else:
                yield from call_events(piece)

    async for event in gen.events():
        tally.add(event)
        if isinstance(event, Delta) and event.text:
            if event.channel is Channel.THINKING:
                for chunk in text_events("reasoning", event.text):
                    yield chunk
            else:
                for chunk in content_events(event.text):
                    yield chunk
        elif isinstance(event, Finished):
            if event.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
                error = from_failure(event.error, state.engine_available)
                yield b.event("error", code=error.code, message=error.message, param=None)
                return
            for chunk in content_events("", final=True):
                yield chunk
            if not output and open_item is None:  # an empty answer: one empty message
                for chunk in text_events("message", ""):
                    yield chunk
            for chunk in close():
                yield chunk
            done = b.response("completed", output, tally.usage(), event.finish_reason)
            name = "response.completed" if done["status"] == "completed" else \
                "response.incomplete"
            yield b.event(name, response=done)


async def create_response(state: ServerState, request: Request, req: GenerationRequest,
                          received_at: float) -> Response:
    """Serves one `POST /v1/responses`, streaming or not."""
    gen = await start(state, req, received_at)
    b = _Builder(state, req)
    if req.stream:
        return EventStream(_stream(state, gen, b), gen.close)
    tally = _Tally(gen)

    async def work() -> Any:
        async for event in gen.events():
            tally.add(event)
        return await gen.handle.aresult()

    result = None
    try:
        result = await until_disconnect(request, work)
    finally:
        gen.close(result is None)
    if result is None:
        return Response(status_code=499)
    if result.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
        return from_failure(result.error, state.engine_available).response(Api.OPENAI)
    text, calls = result.text, []
    if req.parse_tools:
        text, calls = tool_calls.parse(result.text, req.tools)
    return JSONResponse(b.response("completed", _items(result.reasoning_text, text, calls),
                                   tally.usage(), result.finish_reason))
