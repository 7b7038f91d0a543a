"""Slow clients and descriptor exhaustion, on loopback with real sockets: a head trickled
slower than the head timeout is cut, a stalled or trickled body gets a 408 in the API's schema,
an idle keep-alive connection is closed, a storm of idle connections (a subprocess) leaves the
server's descriptors bounded and a good client served, busy connections make newcomers be
refused at once; streaming answers are never cut. Every loop is bounded in count and time."""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import subprocess
import sys
import time

import httpx
import pytest
from anthropic.types import ErrorResponse

from ninfer_jax.errors import ConfigError
from ninfer_jax.gateway import server as server_module
from ninfer_jax.gateway.http import connections
from ninfer_jax.gateway.server import ServerThread, create_app, run_serve
from tests.gateway.conftest import MODEL, assert_fully_free, make_engine, served, wait_idle
from tests.gateway.test_server_lifecycle import metric

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
SLACK_S = 3.0  # scheduling slack on a loaded 2-core machine
TIMER_SLACK_S = 0.05  # uvloop's timers start from the loop's cached clock, a little early
PATHS = {"/v1/chat/completions": "openai", "/v1/messages": "anthropic"}


def _connect(server) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=10)


def _head(path: str, length: int, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n%s\r\n" % (path.encode(), length, extra))


def _closed_by_peer(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server has answered or closed within `wait_s` (data or EOF readable)."""
    return bool(select.select([sock], [], [], wait_s)[0])


def _read_to_eof(sock: socket.socket, timeout_s: float = 10.0) -> bytes:
    """Everything the server sends until it closes (bounded); a reset counts as the close."""
    sock.settimeout(timeout_s)
    data = b""
    for _ in range(1000):
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def _read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response (head, body) on a keep-alive connection, by its content-length."""
    data = b""
    while b"\r\n\r\n" not in data and len(data) < 65536:
        chunk = sock.recv(4096)
        assert chunk, data
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(4096)
        assert chunk, body
        body += chunk
    return head, body


def _error_body(response: bytes, api: str) -> dict:
    head, body = response.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 408 "), response
    assert b"connection: close" in head.lower(), head
    err = json.loads(body)
    if api == "anthropic":
        ErrorResponse.model_validate(err)
        assert err["error"]["type"] == "timeout_error", err
        return err
    assert err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["code"] == "request_timeout", err
    return err


def _num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _wait_fds(at_most: int, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (n := _num_fds()) > at_most and time.monotonic() < deadline:
        time.sleep(0.05)
    return n


@pytest.mark.parametrize("case", ["silent", "partial", "keepalive_partial"])
def test_slow_head_is_cut_after_the_header_timeout(case):
    limit = 0.5
    head = _head("/v1/chat/completions", 2) + b"{}"
    with served(make_engine(), limits={"header_timeout_s": limit}) as s:
        start = time.monotonic()  # the server's clock starts later: at the opening
        with _connect(s) as sock:
            if case == "keepalive_partial":  # one full exchange; the clock restarts after it
                sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                assert _read_response(sock)[1] == b'{"status":"ok"}'
                start = time.monotonic()  # ... at the next byte
            sent = 0
            if case == "silent":
                assert _closed_by_peer(sock, limit + SLACK_S)
            else:  # a byte every 50 ms: a timer between reads would never fire
                for byte in head:
                    sock.sendall(bytes([byte]))
                    sent += 1
                    if _closed_by_peer(sock, 0.05) or time.monotonic() > start + limit + SLACK_S:
                        break
            elapsed = time.monotonic() - start
            response = _read_to_eof(sock)
    assert limit - TIMER_SLACK_S <= elapsed <= limit + SLACK_S, elapsed
    if case == "silent":
        assert response == b""  # nothing was asked, nothing is answered
    else:
        assert sent < len(head)
        assert "header_timeout_s" in _error_body(response, "openai")["error"]["message"]


def test_idle_keepalive_connection_is_closed():
    limit = 0.4
    with served(make_engine(), limits={"keepalive_timeout_s": limit}) as s, _connect(s) as sock:
        for _ in range(2):  # the connection is reused while it is young
            start = time.monotonic()  # the server's clock starts later: at the response's end
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert _read_response(sock)[1] == b'{"status":"ok"}'
        assert _closed_by_peer(sock, limit + SLACK_S)
        elapsed = time.monotonic() - start
        assert _read_to_eof(sock) == b""
    assert limit - TIMER_SLACK_S <= elapsed <= limit + SLACK_S, elapsed


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("trickle", [False, True])
def test_stalled_body_gets_408_and_frees_everything(path, trickle):
    limit = 0.5
    engine = make_engine()
    with served(engine, body_timeout_s=limit) as s:
        with _connect(s) as sock:
            start = time.monotonic()  # the server's clock starts later: at the head
            sock.sendall(_head(path, 1000) + b'{"model": ')
            for _ in range(200):  # trickled: a byte every 50 ms, never the whole body
                if _closed_by_peer(sock, 0.05) or time.monotonic() > start + limit + SLACK_S:
                    break
                if trickle:
                    sock.sendall(b" ")
            elapsed = time.monotonic() - start
            err = _error_body(_read_to_eof(sock), PATHS[path])
        assert limit - TIMER_SLACK_S <= elapsed <= limit + SLACK_S, elapsed
        assert "body_timeout_s" in err["error"]["message"]
        assert_fully_free(engine)
        text = httpx.get(f"{s.url}/metrics").text
        assert metric(text, 'ninfer_rejected_requests_total{reason="timeout"}') == 1
        assert httpx.post(f"{s.url}/v1/chat/completions", json=CHAT).status_code == 200


def test_streaming_answer_outlives_every_timeout_and_a_hang_up_still_cancels():
    engine = make_engine(step_seconds=0.005, eos=False)
    short = {"header_timeout_s": 0.2, "keepalive_timeout_s": 0.2}
    with served(engine, body_timeout_s=0.2, limits=short) as s, httpx.Client(timeout=30) as c:
        start = time.monotonic()
        with c.stream("POST", f"{s.url}/v1/chat/completions",
                      json={**CHAT, "max_tokens": 200, "stream": True}) as r:
            assert r.status_code == 200
            text = ""
            for chunk in r.iter_text():
                text += chunk
                time.sleep(0.002)  # a slow reader is fine: only the client's sending is timed
        assert time.monotonic() - start > 0.6  # several times every limit
        assert text.rstrip().endswith("data: [DONE]") and '"finish_reason": "length"' in text
        with c.stream("POST", f"{s.url}/v1/chat/completions",
                      json={**CHAT, "max_tokens": 400, "stream": True}) as r:
            next(r.iter_lines())  # hang up after the first chunk
        assert wait_idle(engine).generated_tokens < 200 + 400  # cancelled before its budget
        assert_fully_free(engine)


STORM = """
import socket, sys
socks = [socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=10)
         for _ in range(int(sys.argv[2]))]
print("ready", flush=True)
sys.stdin.read()
closed = 0
for s in socks:
    s.setblocking(False)
    try:
        closed += s.recv(1) == b""
    except BlockingIOError:
        pass
    except ConnectionResetError:
        closed += 1
print(closed, flush=True)
"""


def test_idle_connection_storm_keeps_descriptors_bounded():
    num_idle, limit = 300, 16
    engine = make_engine()
    long = {"header_timeout_s": 30.0, "keepalive_timeout_s": 30.0, "max_connections": limit}
    with served(engine, limits=long) as s:
        baseline = _num_fds()
        proc = subprocess.Popen([sys.executable, "-c", STORM, str(s.port), str(num_idle)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert select.select([proc.stdout], [], [], 60)[0], "the storm did not connect"
            assert proc.stdout.readline().strip() == "ready"
            bound = baseline + 2 + limit + 2  # the storm's two pipes, the limit, slack
            assert _wait_fds(bound) <= bound
            start = time.monotonic()
            r = httpx.post(f"{s.url}/v1/chat/completions", json=CHAT, timeout=10)
            assert r.status_code == 200 and time.monotonic() - start < SLACK_S
            assert _num_fds() <= bound
            closed = int(proc.communicate("", timeout=30)[0])  # closing stdin ends the storm
        finally:
            proc.kill()
            proc.wait(30)
        # the server closed all but the newest `limit` idle ones (the timeouts are 30 s)
        assert closed >= num_idle - limit, closed
        assert _wait_fds(baseline) <= baseline  # the storm's end releases the rest
        assert_fully_free(engine)


def test_busy_connections_make_newcomers_be_refused_at_once():
    limit, body_limit = 4, 3.0
    engine = make_engine()
    with served(engine, body_timeout_s=body_limit, limits={"max_connections": limit}) as s:
        busy = [_connect(s) for _ in range(limit)]
        try:
            for sock in busy:  # `100 Continue` proves the app is reading this body
                sock.sendall(_head("/v1/chat/completions", 100, b"expect: 100-continue\r\n"))
                assert sock.recv(100).startswith(b"HTTP/1.1 100 ")
            start = time.monotonic()
            with _connect(s) as newcomer:
                try:
                    newcomer.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
                except OSError:
                    pass  # closed before the request went out
                assert _read_to_eof(newcomer) == b""
            assert time.monotonic() - start < body_limit  # before any busy one ended
            for sock in busy:
                _error_body(_read_to_eof(sock), "openai")
        finally:
            for sock in busy:
                sock.close()
        r = httpx.get(f"{s.url}/health", timeout=10)
        assert r.status_code == 200
        assert_fully_free(engine)


def test_client_gone_mid_body_is_not_an_internal_error(caplog):
    caplog.set_level(logging.WARNING)
    engine = make_engine()
    with served(engine) as s:
        with _connect(s) as sock:
            sock.sendall(_head("/v1/chat/completions", 1000, b"expect: 100-continue\r\n"))
            assert sock.recv(100).startswith(b"HTTP/1.1 100 ")
            sock.sendall(b'{"model": ')
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and not caplog.records:
            time.sleep(0.02)
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
        assert httpx.post(f"{s.url}/v1/chat/completions", json=CHAT).status_code == 200
        assert_fully_free(engine)


@pytest.mark.parametrize("kw, name", [
    ({"header_timeout_s": 0}, "header_timeout_s"),
    ({"keepalive_timeout_s": float("inf")}, "keepalive_timeout_s"),
    ({"body_timeout_s": float("nan")}, "body_timeout_s"),
    ({"body_timeout_s": -1}, "body_timeout_s"),
    ({"max_connections": 0}, "max_connections"),
    ({"max_connections": 2.5}, "max_connections"),
    ({"max_connections": 1 << 40}, "max_connections"),  # over `ulimit -n`
])
def test_bad_limits_are_refused_before_the_model_loads(kw, name):
    serve_kw = {"model": "/nonexistent", "host": "127.0.0.1", "port": 0, "api_key": None,
                "max_concurrency": 1, "max_seq_len": 64, "dtype": "float32"}
    with pytest.raises(ConfigError, match=f"^{name}: "):
        run_serve(**serve_kw, **kw)
    engine = make_engine()
    try:
        with pytest.raises(ConfigError, match=f"^{name}: "):
            if name == "body_timeout_s":
                create_app(engine, **kw)
            else:
                ServerThread(create_app(engine), **kw)
    finally:
        engine.close()


def test_cli_flags_default_to_the_servers_defaults():
    from ninfer_jax.gateway.cli import FLAGS

    assert FLAGS["header_timeout_s"].default == connections.HEADER_TIMEOUT_S
    assert FLAGS["keepalive_timeout_s"].default == connections.KEEPALIVE_TIMEOUT_S
    assert FLAGS["max_connections"].default == connections.MAX_CONNECTIONS
    assert FLAGS["body_timeout_s"].default == server_module.BODY_TIMEOUT_S
    out = subprocess.run([sys.executable, "-m", "ninfer_jax.gateway.cli", "serve",
                          "--max_connections=0"], check=False, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "max_connections: " in out.stderr, out.stderr



@pytest.mark.parametrize("head", [
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: abc\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nno colon here\r\n\r\n",
])
def test_a_malformed_head_gets_a_json_400(head):
    """#41: h11's refusal (a non-numeric Content-Length) was uvicorn's plain-text 400."""
    with served(make_engine()) as server:
        with _connect(server) as sock:
            sock.sendall(head)
            status, body = _read_response(sock)
        assert status.startswith(b"HTTP/1.1 400"), status
        assert b"content-type: application/json" in status.lower()
        error = json.loads(body)["error"]
        assert error["code"] == "invalid_request" and "malformed HTTP request" in error["message"]
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
