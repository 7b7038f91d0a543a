"""Probes, metrics, transport-level errors, overload, Engine failure, and cancellation when the
client disconnects (streaming or not): each leaves the Engine with everything free."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.gateway.conftest import MODEL, assert_fully_free, make_engine, served, wait_idle

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith((name + " ", name + "{")):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def test_probes_and_metrics(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ready").status_code == 200
    httpx.post(f"{server.url}/v1/chat/completions", json={**CHAT, "max_tokens": 5}, timeout=30)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("ninfer_queue_depth", "ninfer_active_requests", "ninfer_generated_tokens_total",
                 "ninfer_generation_tokens_per_second", "ninfer_time_to_first_token_seconds_count",
                 "ninfer_inter_token_latency_seconds_count", "ninfer_prefix_hits_total",
                 "ninfer_prefix_cached_tokens_total", "ninfer_free_pages"):
        metric(text, name)
    assert metric(text, "ninfer_time_to_first_token_seconds_count") >= 1
    assert metric(text, "ninfer_generated_tokens_total") >= 1


@pytest.mark.parametrize("content, headers", [
    (b"{not json", {}),
    (b'{"messages": "\xff\xfe"}', {}),
    (b"[" * 50_000 + b"]" * 50_000, {}),
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', {}),
    (b"", {}),
])
def test_undecodable_bodies_are_400(server, content, headers):
    r = httpx.post(f"{server.url}/v1/chat/completions", content=content, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_body_size_limit():
    with served(make_engine(), max_body_bytes=1000) as s:
        big = json.dumps({**CHAT, "max_tokens": 2, "stop": ["x" * 2000]}).encode()
        r = httpx.post(f"{s.url}/v1/chat/completions", content=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunked():  # no content-length: the limit applies while reading
            yield big[:500]
            yield big[500:]
        r = httpx.post(f"{s.url}/v1/messages", content=chunked())
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
        small = httpx.post(f"{s.url}/v1/chat/completions", json={**CHAT, "max_tokens": 2})
        assert small.status_code == 200


def test_unknown_path_and_method(server):
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(f"{server.url}/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_overload_is_429_at_once():
    engine = make_engine(max_queue=1, step_seconds=0.01, eos=False)
    with served(engine) as s, httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{s.url}/v1/chat/completions",
                           json={**CHAT, "max_tokens": 400, "stream": True}) as held:
            lines = held.iter_lines()
            next(lines)  # the role chunk: the first request holds the capacity
            r = client.post(f"{s.url}/v1/chat/completions", json={**CHAT, "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            r = client.post(f"{s.url}/v1/messages",
                            json={"messages": CHAT["messages"], "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
        assert_fully_free(engine)  # closing the stream cancelled the held request
        text = client.get(f"{s.url}/metrics").text
        assert 'ninfer_rejected_requests_total{reason="overload"} 2.0' in text


def test_engine_failure_is_503_and_not_ready():
    engine = make_engine(fail_commit_at=0)
    with served(engine) as s, httpx.Client(timeout=30) as client:
        r = client.post(f"{s.url}/v1/chat/completions", json={**CHAT, "max_tokens": 5})
        assert r.status_code == 503, r.text
        assert "engine_failed" in r.json()["error"]["message"]
        assert client.get(f"{s.url}/ready").status_code == 503
        assert client.get(f"{s.url}/health").status_code == 200
        r = client.post(f"{s.url}/v1/messages",
                        json={"messages": CHAT["messages"], "max_tokens": 5, "stream": True})
        assert r.status_code == 503 and r.json()["type"] == "error"


def _post_and_vanish(url: str, body: dict, read_bytes: int) -> None:
    """Sends one request on a raw socket, reads a little of the answer, then closes."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                     b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                     % (len(data), data))
        got = b""
        while len(got) < read_bytes:
            chunk = sock.recv(4096)
            if not chunk:
                break
            got += chunk


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_cancels_at_the_engine(stream):
    engine = make_engine(step_seconds=0.01, eos=False)  # 400 tokens would take 4 s
    with served(engine) as s:
        _post_and_vanish(s.url, {**CHAT, "max_tokens": 400, "stream": stream},
                         read_bytes=600 if stream else 0)
        stats = wait_idle(engine)
        assert stats.generated_tokens < 400, stats  # cancelled before its budget
        assert_fully_free(engine)
        text = httpx.get(f"{s.url}/metrics").text
        assert metric(text, "ninfer_client_disconnects_total") == 1
        r = httpx.post(f"{s.url}/v1/chat/completions", json={**CHAT, "max_tokens": 3})
        assert r.status_code == 200  # and the server still answers
