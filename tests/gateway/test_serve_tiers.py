"""`ninfer serve` processes and the context store: a checkpoint on disk survives SIGKILL and a
restart, and two servers share checkpoints through one Redis (real processes, real server,
loopback). Each answer that reused a prefix equals the same request without reuse."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from ninfer_jax.testing.redis_server import RedisServer

START_TIMEOUT_S = 240.0
FIRST = [{"role": "user", "content": "Tell me a short story about a cat and a dog."}]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """One `ninfer serve` subprocess on the demo model."""

    def __init__(self, *flags: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ninfer_jax.gateway.cli", "serve", f"--port={self.port}",
             "--max_concurrency=2", "--max_seq_len=256", "--noverify_weights", *flags],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=os.environ.copy())
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}: "
                                     f"{self.proc.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.kill()
        raise AssertionError("serve did not become ready")

    def chat(self, messages: list[dict], **extra) -> dict:
        body = {"model": "demo", "messages": messages, "temperature": 0, "max_tokens": 12,
                **extra}
        response = httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()

    def metric(self, name: str) -> float:
        """Sum of a /metrics sample's values over its labels."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#")
                   and line[len(name)] in " {")

    def drained(self) -> None:
        """Waits until every checkpoint write this server started has completed."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.metric("ninfer_store_pending_writes") == 0 \
                    and self.metric("ninfer_store_offloads_total") >= 2:
                return
            time.sleep(0.1)
        raise AssertionError("checkpoint writes did not complete")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.proc.stderr.close()


def _turns(first_answer: dict) -> tuple[list[dict], int]:
    answer = first_answer["choices"][0]["message"]["content"]
    follow = FIRST + [{"role": "assistant", "content": answer},
                      {"role": "user", "content": "And then what happened?"}]
    return follow, first_answer["usage"]["prompt_tokens"]


def _text(result: dict) -> str:
    return result["choices"][0]["message"]["content"]


def test_disk_tier_survives_sigkill_and_restart(tmp_path):
    disk = f"--disk_cache_dir={tmp_path}"
    server = Server(disk)
    try:
        follow, first_prompt = _turns(server.chat(FIRST))
        server.drained()
    finally:
        server.kill()  # mid-conversation, no clean shutdown
    server = Server(disk)
    try:
        reused = server.chat(follow)
        assert reused["usage"]["prompt_tokens_details"]["cached_tokens"] >= first_prompt
        assert server.metric("ninfer_store_hits_total") == 1
        fresh = server.chat(follow, cache_salt="no reuse")
        assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert _text(reused) == _text(fresh)
    finally:
        server.kill()


@pytest.mark.slow  # ~30 s; the Engine over a real Redis: tests/engine/test_tiers_storm.py
def test_two_servers_share_one_redis():
    with RedisServer() as redis:
        flag = f"--redis_url={redis.url}"
        first = Server(flag)
        try:
            follow, first_prompt = _turns(first.chat(FIRST))
            first.drained()
            second = Server(flag)
            try:
                reused = second.chat(follow)
                assert reused["usage"]["prompt_tokens_details"]["cached_tokens"] >= first_prompt
                text = httpx.get(f"{second.url}/metrics", timeout=10).text
                assert 'ninfer_store_hits_total{tier="redis"} 1.0' in text
            finally:
                second.kill()
            fresh = first.chat(follow, cache_salt="no reuse")
            assert _text(reused) == _text(fresh)
        finally:
            first.kill()
