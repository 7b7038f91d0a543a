"""Load on loopback: 32 concurrent clients against max_concurrency=4 (and a small queue, so
overload happens), a third of them hanging up mid-stream at random. Every request must end as a
complete answer, a clean 429/503, or the client's own disconnect; afterwards the Engine is idle
with every lane, page and slot free, and the server still answers. Bounded in time and count."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

import httpx
import pytest

from tests.gateway.conftest import MODEL, assert_fully_free, make_engine, served

NUM_CLIENTS = 32
MAX_REQUESTS = 20_000  # a hard cap besides the duration


@dataclasses.dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    overloaded: int = 0  # 429
    unavailable: int = 0  # 503
    disconnected: int = 0  # the client hung up mid-stream on purpose
    bad: list[str] = dataclasses.field(default_factory=list)


def _body(rng: random.Random, kind: str) -> tuple[str, dict]:
    messages = [{"role": "user", "content": "q" * rng.randint(1, 40)}]
    budget = rng.randint(4, 48)
    if kind == "messages":
        return "/v1/messages", {"model": MODEL, "messages": messages, "max_tokens": budget,
                                "stream": True}
    if kind == "completions":
        return "/v1/completions", {"model": MODEL, "prompt": "p" * rng.randint(1, 40),
                                   "max_tokens": budget, "stream": rng.random() < 0.5}
    return "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": budget,
                                    "stream": rng.random() < 0.7,
                                    "seed": rng.randint(0, 99)}


def _complete(kind: str, stream: bool, text: str) -> bool:
    """Whether a 200 answer is whole: the stream's terminator, or a finish reason."""
    if not stream:
        body = json.loads(text)
        if kind == "messages":
            return body["stop_reason"] in ("end_turn", "max_tokens")
        return body["choices"][0]["finish_reason"] in ("stop", "length")
    if kind == "messages":
        return text.rstrip().endswith('data: {"type": "message_stop"}')
    return text.rstrip().endswith("data: [DONE]") and '"finish_reason": "' in text


async def _client(client: httpx.AsyncClient, url: str, index: int, deadline: float,
                  tally: Tally) -> None:
    rng = random.Random(index)
    hangs_up = index % 3 == 0
    while time.monotonic() < deadline and tally.requests < MAX_REQUESTS:
        kind = rng.choice(["chat", "chat", "completions", "messages"])
        path, body = _body(rng, kind)
        stream = body.get("stream", False)
        tally.requests += 1
        cut_after = rng.randint(1, 8) if hangs_up and stream else None
        async with client.stream("POST", url + path, json=body) as r:
            if r.status_code in (429, 503):
                err = json.loads(await r.aread())
                assert "error" in err
                if r.status_code == 429:
                    tally.overloaded += 1
                else:
                    tally.unavailable += 1
                await asyncio.sleep(rng.uniform(0.01, 0.1))
                continue
            if r.status_code != 200:
                tally.bad.append(f"{r.status_code} {(await r.aread())[:200]!r}")
                continue
            if cut_after is not None:
                lines = 0
                async for _ in r.aiter_lines():
                    lines += 1
                    if lines >= cut_after:
                        break
                else:
                    tally.completed += 1  # the answer ended before the hang-up point
                    continue
                tally.disconnected += 1
                continue  # leaving the block closes the connection mid-stream
            text = (await r.aread()).decode()
            if _complete(kind, stream, text):
                tally.completed += 1
            else:
                tally.bad.append(f"incomplete {kind} stream={stream}: {text[-200:]!r}")


async def _run(url: str, duration_s: float) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + duration_s
    limits = httpx.Limits(max_connections=NUM_CLIENTS * 2)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        await asyncio.wait_for(
            asyncio.gather(*(_client(client, url, i, deadline, tally)
                             for i in range(NUM_CLIENTS))),
            timeout=duration_s + 60)
    return tally


def run_load(duration_s: float) -> Tally:
    engine = make_engine(max_concurrency=4, max_queue=12, step_seconds=0.002)
    with served(engine) as s:
        tally = asyncio.run(_run(s.url, duration_s))
        assert_fully_free(engine)
        r = httpx.post(f"{s.url}/v1/chat/completions", timeout=30, json={
            "model": MODEL, "messages": [{"role": "user", "content": "still there?"}],
            "max_tokens": 3})
        assert r.status_code == 200
    print(f"\nload {duration_s:g}s: {tally.requests} requests, {tally.completed} completed, "
          f"{tally.overloaded} x 429, {tally.unavailable} x 503, "
          f"{tally.disconnected} disconnects")
    assert tally.bad == [], tally.bad[:5]
    assert tally.requests == (tally.completed + tally.overloaded + tally.unavailable
                              + tally.disconnected)
    assert tally.completed > 0 and tally.disconnected > 0 and tally.overloaded > 0
    return tally


def test_load_ci():
    run_load(10.0)


@pytest.mark.slow
def test_load_full():
    run_load(30.0)
