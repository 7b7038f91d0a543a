"""`ninfer serve`: the HTTP gateway, an OpenAI- and Anthropic-compatible Starlette app on uvicorn.

Owns the routes, authentication (`Authorization: Bearer` or `x-api-key`), the body size and
time limits (a body not complete within `body_timeout_s` of the head gets a 408), the served
model's id, and running the app (`serve` blocks; `ServerThread` runs it in the background for
tests, benchmarks and notebooks) with the connection limits of `gateway/http/connections.py`
(head timeout, keep-alive timeout, maximum connections). Protocol details live in
`gateway/http/`; order, cache and physical state stay with the Engine (DESIGN §2).

Endpoints: `GET /health`, `GET /ready`, `GET /metrics`, `GET /v1/models[/{id}]`,
`POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/responses`, `POST /v1/messages`,
`POST /v1/messages/count_tokens`, `POST /tokenize`, `POST /detokenize`, `GET /tokenizer_info`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import hmac
import logging
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Self

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ninfer_jax.errors import ConfigError
from ninfer_jax.gateway.http import anthropic_api, openai_api, responses_api, tokens_api
from ninfer_jax.gateway.http.anthropic_requests import parse_messages
from ninfer_jax.gateway.http.connections import (
    HEADER_TIMEOUT_S,
    KEEPALIVE_TIMEOUT_S,
    MAX_CONNECTIONS,
    ConnectionLimits,
    GuardedH11Protocol,
    positive_seconds,
)
from ninfer_jax.gateway.http.errors import Api, ApiError
from ninfer_jax.gateway.http.fields import decode_json
from ninfer_jax.gateway.http.logprobs import PromptScorer
from ninfer_jax.gateway.http.metrics import Metrics
from ninfer_jax.gateway.http.openai_requests import parse_chat, parse_completion
from ninfer_jax.gateway.http.request_id import RequestIdMiddleware
from ninfer_jax.gateway.http.requests import GenerationRequest
from ninfer_jax.gateway.http.responses_requests import parse_responses
from ninfer_jax.gateway.http.state import ServerState

if TYPE_CHECKING:
    from ninfer_jax.api import Engine

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 4 << 20
BODY_TIMEOUT_S = 60.0  # nginx's client_body_timeout, here a total: trickling does not extend it
_REJECTION = {400: "invalid", 401: "unauthorized", 404: "unknown_model", 408: "timeout",
              413: "too_large", 429: "overload", 503: "unavailable"}

Handler = Callable[[ServerState, Request, GenerationRequest, float], Awaitable[Response]]


def _api(path: str) -> Api:
    return Api.ANTHROPIC if path.startswith("/v1/messages") else Api.OPENAI


def api_keys(api_key: str | Sequence[str] | None) -> tuple[str, ...]:
    """The accepted keys: none (auth off), one, or several (one tenant each)."""
    keys = () if api_key is None else (api_key,) if isinstance(api_key, str) else tuple(api_key)
    for key in keys:
        if not isinstance(key, str) or not key.strip() or key != key.strip():
            raise ConfigError("api_key must be a non-empty string without surrounding spaces")
    return keys


def _authorize(request: Request, keys: tuple[str, ...]) -> str | None:
    """The tenant of the request: None with auth off, else an opaque id of the matching key.
    Every key is compared (constant time each), so timing does not tell which one matched."""
    if not keys:
        return None
    given = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if given is None and auth[:7].lower() == "bearer ":
        given = auth[7:].strip()
    matched = None
    for key in keys:
        if given is not None and hmac.compare_digest(given.encode(), key.encode()):
            matched = key
    if matched is None:
        raise ApiError(401, "missing or wrong API key (Authorization: Bearer KEY or x-api-key)",
                       code="invalid_api_key")
    return hashlib.sha256(matched.encode()).hexdigest()[:16]


async def _read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    too_large = ApiError(413, f"request body over the {limit}-byte limit",
                         code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"request body not complete within {timeout_s:g} s "
                       "(body_timeout_s)", code="request_timeout") from None
    return b"".join(chunks)


def _generation_endpoint(state: ServerState, api: Api,
                         parse: Callable[[Any, str | None], GenerationRequest],
                         handler: Handler) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        received_at = time.monotonic()
        try:
            tenant = _authorize(request, state.api_keys)
            body = await _read_body(request, state.max_body_bytes, state.body_timeout_s)
            session = request.headers.get("x-session-id")
            req = await state.off_loop(lambda: parse(decode_json(body), session),
                                       body_bytes=len(body))
            # prefix reuse stays in the tenant; the body's size picks its work lane
            req = dataclasses.replace(req, tenant=tenant, body_bytes=len(body))
            if req.model is not None and req.model != state.model_name:
                raise ApiError(404, f"model {req.model!r:.80} not found; this server serves "
                               f"{state.model_name!r}", param="model", code="model_not_found")
            return await handler(state, request, req, received_at)
        except ApiError as e:
            reason = "too_long" if e.code == "context_length_exceeded" else \
                _REJECTION.get(e.status, "error")
            state.metrics.rejections.labels(reason).inc()
            return e.response(api)
        except ClientDisconnect:  # gone before its body was complete: nobody to answer
            return Response(status_code=400)
        except Exception:  # a bug, never bad input: answer in the API's schema, keep serving
            log.exception("internal error serving %s", request.url.path)
            return ApiError(500, "internal server error", code="internal_error").response(api)

    return endpoint


def check_origins(origins: str | Sequence[str] | None) -> tuple[str, ...]:
    """CORS origins: none (CORS off), "*" or full origins such as `https://app.example`."""
    found = () if origins is None else (origins,) if isinstance(origins, str) else tuple(origins)
    for origin in found:
        if not isinstance(origin, str) or not (origin == "*" or "://" in origin) \
                or origin != origin.strip() or origin.endswith("/"):
            raise ConfigError(f"allowed_origins: {origin!r:.80} is not '*' or an origin like "
                              "https://host[:port] (no path, no trailing slash)")
    return found


def _json_endpoint(state: ServerState, api: Api,
                   handler: Callable[..., Response]) -> Callable[[Request], Awaitable[Response]]:
    """A POST endpoint with a JSON body that generates nothing: auth, body limits, model id."""
    async def endpoint(request: Request) -> Response:
        try:
            _authorize(request, state.api_keys)
            body = await _read_body(request, state.max_body_bytes, state.body_timeout_s)
            obj = await state.off_loop(decode_json, body, body_bytes=len(body))
            model = obj.get("model") if isinstance(obj, dict) else None
            if model is not None and model != state.model_name:
                raise ApiError(404, f"model {model!r:.80} not found; this server serves "
                               f"{state.model_name!r}", param="model", code="model_not_found")
            return await state.off_loop(handler, state, obj, request.headers.get("x-session-id"),
                                        body_bytes=len(body))
        except ApiError as e:
            state.metrics.rejections.labels(_REJECTION.get(e.status, "error")).inc()
            return e.response(api)
        except ClientDisconnect:
            return Response(status_code=400)
        except Exception:  # a bug, never bad input
            log.exception("internal error serving %s", request.url.path)
            return ApiError(500, "internal server error", code="internal_error").response(api)

    return endpoint


def create_app(engine: Engine, *, model_name: str | None = None,
               api_key: str | Sequence[str] | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               body_timeout_s: float = BODY_TIMEOUT_S,
               allowed_origins: str | Sequence[str] | None = None,
               prompt_scorer: PromptScorer | bool | None = True) -> Starlette:
    """The ASGI app over a running `Engine`. `model_name` is the id clients send as `model`
    (default: the model directory's name, or "ninfer"). `allowed_origins`: browser origins
    allowed by CORS (off when None). Every response carries `x-request-id` (the client's own,
    when it sent a usable one). `prompt_scorer`: what scores prompts for `echo` with logprobs
    (True: the served model's CausalScoring purpose, opened on first use; None: refused)."""
    body_timeout_s = positive_seconds("body_timeout_s", body_timeout_s)
    origins = check_origins(allowed_origins)
    if model_name is None:
        path = engine.model_path
        model_name = path.name if path is not None else "ninfer"
    if prompt_scorer is True:
        path = engine.model_path
        prompt_scorer = None if path is None else PromptScorer(path, max_len=engine.max_seq_len)
    state = ServerState(engine, model_name, Metrics(engine), api_keys(api_key), max_body_bytes,
                        body_timeout_s, prompt_scorer)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        if state.engine_available:
            return JSONResponse({"status": "ready"})
        return ApiError(503, "the Engine is not available", code="unavailable").response(
            Api.OPENAI)

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    def model_card() -> dict[str, Any]:
        return {"id": state.model_name, "object": "model", "created": state.created,
                "owned_by": "ninfer", "max_model_len": engine.max_seq_len}

    async def tokenizer_info(request: Request) -> Response:
        try:
            _authorize(request, state.api_keys)
        except ApiError as e:
            return e.response(Api.OPENAI)
        return tokens_api.tokenizer_info(state)

    async def list_models(request: Request) -> Response:
        try:
            _authorize(request, state.api_keys)
        except ApiError as e:
            return e.response(Api.OPENAI)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def get_model(request: Request) -> Response:
        try:
            _authorize(request, state.api_keys)
        except ApiError as e:
            return e.response(Api.OPENAI)
        if request.path_params["model"] != state.model_name:
            return ApiError(404, f"model {request.path_params['model']!r:.80} not found",
                            param="model", code="model_not_found").response(Api.OPENAI)
        return JSONResponse(model_card())

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        return ApiError(status, f"{request.method} {request.url.path}: "
                        f"{getattr(exc, 'detail', 'error')}").response(_api(request.url.path))

    routes = [
        Route("/health", health),
        Route("/ready", ready),
        Route("/metrics", metrics),
        Route("/v1/models", list_models),
        Route("/v1/models/{model:path}", get_model),
        Route("/v1/chat/completions", _generation_endpoint(
            state, Api.OPENAI, parse_chat, functools.partial(openai_api.complete, chat=True)),
              methods=["POST"]),
        Route("/v1/completions",
              _generation_endpoint(state, Api.OPENAI, parse_completion,
                                   functools.partial(openai_api.complete, chat=False)),
              methods=["POST"]),
        Route("/v1/responses", _generation_endpoint(state, Api.OPENAI,
                                                    parse_responses,
                                                    responses_api.create_response),
              methods=["POST"]),
        Route("/v1/messages", _generation_endpoint(state, Api.ANTHROPIC, parse_messages,
                                                   anthropic_api.create_message),
              methods=["POST"]),
        Route("/v1/messages/count_tokens",
              _json_endpoint(state, Api.ANTHROPIC, tokens_api.count_tokens), methods=["POST"]),
        Route("/tokenize", _json_endpoint(
            state, Api.OPENAI, lambda st, obj, _: tokens_api.tokenize(st, obj)),
              methods=["POST"]),
        Route("/detokenize", _json_endpoint(
            state, Api.OPENAI, lambda st, obj, _: tokens_api.detokenize(st, obj)),
              methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info),
    ]
    middleware = [Middleware(RequestIdMiddleware)]
    if origins:
        middleware.append(Middleware(
            CORSMiddleware, allow_origins=list(origins), allow_methods=["GET", "POST"],
            allow_headers=["*"], expose_headers=["x-request-id"]))
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error},
                    middleware=middleware)
    app.state.server = state
    return app


def _config(app: Starlette, host: str, port: int, limits: ConnectionLimits) -> uvicorn.Config:
    return uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                          timeout_graceful_shutdown=5, access_log=False, ws="none",
                          http=GuardedH11Protocol.bound_to(limits),
                          timeout_keep_alive=limits.keepalive_timeout_s)  # type: ignore[arg-type]


class ServerThread:
    """Runs an app on uvicorn in a background thread: `with ServerThread(app) as s: s.url`.
    Port 0 picks a free port. The limits are those of `serve`."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0,
                 start_timeout_s: float = 30.0, *, header_timeout_s: float = HEADER_TIMEOUT_S,
                 keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS):
        limits = ConnectionLimits(header_timeout_s, keepalive_timeout_s, max_connections)
        self.server = uvicorn.Server(_config(app, host, port, limits))
        self.host, self.start_timeout_s = host, start_timeout_s
        self._thread = threading.Thread(target=self.server.run, name="ninfer-http", daemon=True)
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> Self:
        self._thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.host}")
            time.sleep(0.01)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self._thread.join(self.start_timeout_s)


def serve(engine: Engine, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | Sequence[str] | None = None, model_name: str | None = None,
          header_timeout_s: float = HEADER_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S,
          keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
          max_connections: int = MAX_CONNECTIONS,
          allowed_origins: str | Sequence[str] | None = None) -> None:
    """Serves `engine` until interrupted (SIGINT/SIGTERM). A request head must be complete
    within `header_timeout_s` and its body within `body_timeout_s` (else 408); an idle
    keep-alive connection closes after `keepalive_timeout_s`; beyond `max_connections` open
    connections a new one evicts the one waiting longest for a request head, or is closed at
    once when every connection is serving a request."""
    limits = ConnectionLimits(header_timeout_s, keepalive_timeout_s, max_connections)
    app = create_app(engine, model_name=model_name, api_key=api_key,
                     body_timeout_s=body_timeout_s, allowed_origins=allowed_origins)
    name = app.state.server.model_name
    print(f"[ninfer] serving {name!r} on http://{host}:{port} "
          f"(auth {'on' if app.state.server.api_keys else 'off'})", file=sys.stderr)
    uvicorn.Server(_config(app, host, port, limits)).run()


def run_serve(*, model: str | None, host: str, port: int, api_key: str | Sequence[str] | None,
              max_concurrency: int, max_seq_len: int, dtype: str, verify_weights: bool = True,
              header_timeout_s: float = HEADER_TIMEOUT_S, body_timeout_s: float = BODY_TIMEOUT_S,
              keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S,
              max_connections: int = MAX_CONNECTIONS,
              allowed_origins: str | Sequence[str] | None = None, **engine_settings: Any) -> int:
    """`ninfer serve`: opens the Engine, serves until interrupted, closes the Engine. The
    server's limits are checked before the model loads. `engine_settings` go to `Engine.open`
    (e.g. speculative, num_speculative_tokens)."""
    ConnectionLimits(header_timeout_s, keepalive_timeout_s, max_connections)
    positive_seconds("body_timeout_s", body_timeout_s)
    api_keys(api_key)
    check_origins(allowed_origins)
    from ninfer_jax.api import Engine

    start = time.perf_counter()
    engine = Engine.open(model, max_concurrency=max_concurrency, max_seq_len=max_seq_len,
                         dtype=dtype, verify_weights=verify_weights, **engine_settings)
    try:
        warm = engine.warm_up()  # before the port opens: /ready then means ready
        print(f"[ninfer] model {engine.model_path} ready in {time.perf_counter() - start:.1f}s "
              f"({engine.describe()}; warm-up request {warm:.1f}s)",
              file=sys.stderr)
        serve(engine, host=host, port=port, api_key=api_key, header_timeout_s=header_timeout_s,
              body_timeout_s=body_timeout_s, keepalive_timeout_s=keepalive_timeout_s,
              max_connections=max_connections, allowed_origins=allowed_origins)
    finally:
        engine.close()
    return 0
