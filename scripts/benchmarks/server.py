"""HTTP server throughput and time to first token at client concurrency 1, 2, 4, 8, 16.

    python scripts/bench.py --suite=server --out=DIR     (env BENCH_SERVER_ENGINE=fake|demo)

A live `ninfer serve` app (uvicorn, 127.0.0.1, a free port) in this process; the clients run in
a child process (their own interpreter, so they do not share this one's GIL) as C concurrent
asyncio streams of `POST /v1/chat/completions` (stream, include_usage, greedy, 32 new tokens),
each client running REQUESTS_PER_CLIENT requests back to back. TTFT is measured from sending
the request to the first content chunk; tok/s is completion tokens (from the usage chunk) over
the wall time of the whole level.

Engines: `fake` (default) is the FakeProgram with a 5 ms step and no EOS behind the real
EngineCore, Frontend and server, so the numbers are the serving stack's own cost at a fixed
model speed; `demo` is the embedded demo model (`Engine.open()`), max_concurrency 8.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import statistics
import time
from typing import Any

from ninfer_jax.gateway.server import ServerThread, create_app

LEVELS = (1, 2, 4, 8, 16)
REQUESTS_PER_CLIENT = 8
MAX_TOKENS = 32
MODEL = "bench"


def _fake_engine() -> Any:
    from ninfer_jax.api import Engine
    from ninfer_jax.engine import EngineCore, EngineCoreConfig
    from ninfer_jax.frontend import ChatTemplate, Frontend
    from ninfer_jax.program.host import ProgramLimits
    from ninfer_jax.testing.fake_program import FakeProgram
    from ninfer_jax.testing.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    frontend = Frontend(tokenizer, ChatTemplate(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant\n"))
    limits = ProgramLimits(max_seq_len=512, page_size=16, total_pages=8 * 32, total_slots=8,
                           max_concurrency=8, prefill_chunk=128,
                           vocab_size=tokenizer.vocab_size, total_checkpoint_slots=16)
    program = FakeProgram(limits, eos_id=None, step_seconds=0.005)
    core = EngineCore(program, frontend, EngineCoreConfig(max_queue=64))
    return Engine(core, frontend, None)


def _engine(kind: str) -> Any:
    if kind == "fake":
        return _fake_engine()
    from ninfer_jax.api import Engine

    return Engine.open(max_concurrency=8, max_seq_len=1024)


async def _client(client: Any, url: str, index: int) -> list[tuple[float, int]]:
    out = []
    for i in range(REQUESTS_PER_CLIENT):
        body = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
                "temperature": 0, "max_tokens": MAX_TOKENS,
                "messages": [{"role": "user", "content": f"client {index} request {i}: "
                              + "tell me a story " * 4}]}
        start, ttft, tokens = time.perf_counter(), None, 0
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and chunk["choices"] and any(
                        chunk["choices"][0]["delta"].get(k) for k in
                        ("content", "reasoning_content")):
                    ttft = time.perf_counter() - start
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        out.append((ttft if ttft is not None else time.perf_counter() - start, tokens))
    return out


async def _level(url: str, concurrency: int) -> dict[str, Any]:
    import httpx

    async with httpx.AsyncClient(timeout=300) as client:
        start = time.perf_counter()
        per_client = await asyncio.gather(*(_client(client, url, i)
                                            for i in range(concurrency)))
        wall = time.perf_counter() - start
    results = [r for rs in per_client for r in rs]
    ttfts = sorted(t for t, _ in results)
    tokens = sum(n for _, n in results)
    return {"concurrency": concurrency, "requests": len(results), "tokens": tokens,
            "wall_s": wall, "tok_per_s": tokens / wall, "req_per_s": len(results) / wall,
            "ttft_p50_ms": 1e3 * statistics.median(ttfts),
            "ttft_p99_ms": 1e3 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]}


def _drive(url: str, queue: Any) -> None:
    """Child process: every level in order, results back through `queue`."""
    asyncio.run(_level(url, 1))  # warm-up: connections, first compiles
    queue.put([asyncio.run(_level(url, c)) for c in LEVELS])


def run(out_dir: str) -> dict[str, Any]:
    del out_dir
    kind = os.environ.get("BENCH_SERVER_ENGINE", "fake")
    engine = _engine(kind)
    try:
        with ServerThread(create_app(engine, model_name=MODEL)) as server:
            ctx = multiprocessing.get_context("spawn")
            queue = ctx.Queue()
            child = ctx.Process(target=_drive, args=(server.url, queue))
            child.start()
            levels = queue.get(timeout=1800)
            child.join(60)
    finally:
        engine.close()
    print(f"server suite, engine={kind}, {REQUESTS_PER_CLIENT} requests per client, "
          f"{MAX_TOKENS} new tokens, streaming chat")
    print(f"{'clients':>7} {'requests':>8} {'tok/s':>9} {'req/s':>7} {'TTFT p50 ms':>12} "
          f"{'TTFT p99 ms':>12}")
    for r in levels:
        print(f"{r['concurrency']:>7} {r['requests']:>8} {r['tok_per_s']:>9.1f} "
              f"{r['req_per_s']:>7.2f} {r['ttft_p50_ms']:>12.1f} {r['ttft_p99_ms']:>12.1f}")
    return {"engine": kind, "requests_per_client": REQUESTS_PER_CLIENT,
            "max_tokens": MAX_TOKENS, "levels": levels}
