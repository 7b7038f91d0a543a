"""`x-request-id` on every response: the client's own id when it sent a usable one, else a new one.

A pure ASGI middleware (it only adds a header to `http.response.start`), so streaming and the
disconnect watching of `generation.py` pass through untouched. A client id is echoed only when it
is 1-128 visible ASCII characters; anything else is replaced, never reflected.
"""

from __future__ import annotations

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
_USABLE = re.compile(rb"^[\x21-\x7e]{1,128}$")


def request_id(scope: Scope) -> bytes:
    """The id of the request in `scope`: the client's, when usable, else a fresh one."""
    for name, value in scope.get("headers", ()):
        if name == HEADER and _USABLE.match(value):
            return value
    return uuid.uuid4().hex.encode()


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope)
        scope.setdefault("state", {})["request_id"] = rid.decode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k != HEADER]
                message = {**message, "headers": [*headers, (HEADER, rid)]}
            await send(message)

        await self.app(scope, receive, send_with_id)
