"""Connection lifetimes of the HTTP server: how long a client may take to send a request head,
how long an idle keep-alive connection stays open, and how many connections are open at once.

Owns `ConnectionLimits` and `GuardedH11Protocol`, a small subclass of uvicorn's h11 protocol
(`uvicorn.Config(http=GuardedH11Protocol.bound_to(limits))`). uvicorn itself times only the
keep-alive idle period after a response (`timeout_keep_alive`, used here as is): a fresh
connection has no timer until its first response, a half-sent head none at all, and
`limit_concurrency` acts only once a head has arrived, while the descriptor is already held.

- Head timeout: the head must be complete within `header_timeout_s` of the connection opening,
  or, on a keep-alive connection, of its first byte after the previous response (until that
  byte the keep-alive timer applies). A partial head then gets a 408 and the connection closes;
  a connection that sent nothing is closed quietly. The time is a total, not a gap between
  reads, so trickling bytes does not extend it.
- Connection limit: a connection beyond `max_connections` first evicts the connection that has
  waited longest without a request in progress (head incomplete or idle keep-alive: nothing has
  been promised to it); when every connection is serving a request, the newcomer is closed at
  once, before anything is read from it.

Only the client-to-server direction is timed: once a head is complete nothing here cuts the
exchange (a long streaming answer runs to its end). The body is timed by the app, which knows
the API to answer in (`gateway/server.py`). Runs on the event loop thread only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import resource
from collections import OrderedDict
from typing import Any, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ninfer_jax.errors import ConfigError
from ninfer_jax.gateway.http.errors import Api, ApiError

HEADER_TIMEOUT_S = 60.0  # nginx's client_header_timeout
KEEPALIVE_TIMEOUT_S = 5.0  # uvicorn's timeout_keep_alive
MAX_CONNECTIONS = 512  # nginx's worker_connections
RESERVED_FDS = 64  # descriptors kept for the process itself (model files, pipes, logs)


def positive_seconds(name: str, value: float) -> float:
    """`value` as float seconds; a ConfigError naming `name` unless it is finite and > 0."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}: must be a positive, finite number of seconds, got {value!r}")
    return float(value)


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    """The transport's limits; validated at construction (a ConfigError names the setting)."""

    header_timeout_s: float = HEADER_TIMEOUT_S
    keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS

    def __post_init__(self) -> None:
        positive_seconds("header_timeout_s", self.header_timeout_s)
        positive_seconds("keepalive_timeout_s", self.keepalive_timeout_s)
        n = self.max_connections
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"max_connections: must be an integer >= 1, got {n!r}")
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and n > soft - RESERVED_FDS:
            raise ConfigError(f"max_connections: {n} is over the open-file limit {soft} "
                              f"(`ulimit -n`) less {RESERVED_FDS} kept for the process")


class ConnectionGuard:
    """One server's open connections, and those waiting for a request head, oldest first."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self._open: set[GuardedH11Protocol] = set()
        self._waiting: OrderedDict[GuardedH11Protocol, None] = OrderedDict()

    def admit(self, conn: GuardedH11Protocol) -> bool:
        """Whether `conn` may stay open: under the limit, or by evicting the longest waiter."""
        if len(self._open) >= self.limits.max_connections:
            if not self._waiting:
                return False
            oldest, _ = self._waiting.popitem(last=False)
            self.release(oldest)
            oldest.close()
        self._open.add(conn)
        self._waiting[conn] = None
        return True

    def waiting(self, conn: GuardedH11Protocol) -> None:
        """`conn` has no request in progress (kept in line if it already was)."""
        if conn in self._open and conn not in self._waiting:
            self._waiting[conn] = None

    def busy(self, conn: GuardedH11Protocol) -> None:
        self._waiting.pop(conn, None)

    def release(self, conn: GuardedH11Protocol) -> None:
        self._open.discard(conn)
        self._waiting.pop(conn, None)


def _head_timeout_response(limit_s: float) -> bytes:
    body = json.dumps(ApiError(408, f"request head not complete within {limit_s:g} s "
                               "(header_timeout_s)", code="request_timeout").body(Api.OPENAI))
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body.encode()))


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head timeout and a connection limit (module docstring)."""

    guard: ClassVar[ConnectionGuard]

    @classmethod
    def bound_to(cls, limits: ConnectionLimits) -> type[GuardedH11Protocol]:
        """The protocol class for one server: its own guard, shared by its connections."""
        return type(cls.__name__, (cls,), {"guard": ConnectionGuard(limits)})

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._admitted = False

    @property
    def _busy(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
        if not self.guard.admit(self):
            transport.close()
            return
        self._admitted = True
        super().connection_made(transport)  # type: ignore[arg-type]
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._admitted:
            return
        self._cancel_head_timer()
        self.guard.release(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and not self._busy:
            self._arm_head_timer()  # the first byte after a response starts the next head
        super().data_received(data)
        self._settle()

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (a non-numeric Content-Length, a bad header line): the
        400 in the API's JSON shape (uvicorn's own is plain text), then the connection
        closes."""
        body = json.dumps(ApiError(400, f"malformed HTTP request: {msg}",
                                   code="invalid_request").body(Api.OPENAI)).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                   (b"content-length", str(len(body)).encode())]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._settle()

    def close(self) -> None:
        """Closes the connection at once (eviction, head timeout)."""
        self._cancel_head_timer()
        if not self.transport.is_closing():
            self.transport.close()

    def _settle(self) -> None:
        if self.transport.is_closing():
            self._cancel_head_timer()
            self.guard.release(self)
        elif self._busy:
            self._cancel_head_timer()
            self.guard.busy(self)
        else:
            self.guard.waiting(self)

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.guard.limits.header_timeout_s,
                                                self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self.transport.write(_head_timeout_response(self.guard.limits.header_timeout_s))
        self.guard.release(self)
        self.close()
