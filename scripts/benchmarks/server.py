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

Then, always on the embedded demo model (max_concurrency 4; its own server), in turns A B A B
(REPS each, after one warm-up of each):
- JSON schema: GRAMMAR_CLIENTS concurrent non-streaming chat requests, greedy, MAX_TOKENS new
  tokens, `response_format` json_schema (one string property whose minLength keeps the answer
  open, so the budget ends both sides' answers: equal work) against the same requests without
  it; tok/s is completion tokens over wall time, the ratio is with / without (target >= 0.8).
  Every constrained answer is checked to start as the schema's object. Also the host's mask
  time per token (a matcher replaying the answers).
- n = 4: one completions request with n = 4 (seeded sampling) against four separate
  concurrent requests with distinct `cache_salt` (so nothing is shared); reported: the
  prompt tokens prefilled (the admitted prompts, the n = 4 request's priming of its prefix
  included, minus the Engine's prefix `cached_tokens` gained), the admissions that found no
  checkpoint (prefills from the root), and tok/s.
- Event loop under load: STALL_CLIENTS clients each send a maximal legal chat body (just under
  the 4 MiB limit: one long message, then 60,000 short messages) while a probe in its own process asks `/health` and tokenizes a sentence
  every 20 ms: their median, p99 and max latency (target: `/health` max <= 100 ms).
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
    from ninfer_jax.program.limits import ProgramLimits
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


GRAMMAR_CLIENTS = 4
REPS = 3
# minLength: the string cannot close within the budget, so with and without the grammar every
# request produces exactly MAX_TOKENS tokens (the same work per turn).
SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 1000}},
          "required": ["story"], "additionalProperties": False}


def _post_all(url: str, bodies: list[dict]) -> tuple[float, list[dict]]:
    """Wall time and responses of `bodies` sent concurrently."""
    import httpx

    async def go():
        async with httpx.AsyncClient(timeout=600) as client:
            start = time.perf_counter()
            rs = await asyncio.gather(*(client.post(url, json=b) for b in bodies))
            wall = time.perf_counter() - start
        for r in rs:
            r.raise_for_status()
        return wall, [r.json() for r in rs]

    return asyncio.run(go())


def _grammar_turn(url: str, constrained: bool) -> dict[str, Any]:
    bodies = []
    for i in range(GRAMMAR_CLIENTS):
        body = {"model": MODEL, "temperature": 0, "max_tokens": MAX_TOKENS,
                "messages": [{"role": "user", "content": f"story {i}: once upon a time"}]}
        if constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "story", "schema": SCHEMA, "strict": True}}
        bodies.append(body)
    wall, outs = _post_all(f"{url}/v1/chat/completions", bodies)
    texts = [o["choices"][0]["message"]["content"] for o in outs]
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    return {"wall_s": wall, "tokens": tokens, "tok_per_s": tokens / wall, "texts": texts,
            "finish": [o["choices"][0]["finish_reason"] for o in outs]}


def _n_turn(url: str, engine: Any, shared: bool, salt: int) -> dict[str, Any]:
    prompt = f"run {salt}: " + "the little dog ran to the park and " * 6
    base = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 1.0,
            "seed": 1}
    before = engine.stats().prefix
    if shared:
        wall, outs = _post_all(f"{url}/v1/completions", [{**base, "n": 4}])
    else:
        wall, outs = _post_all(f"{url}/v1/completions", [
            {**base, "seed": 1 + j, "cache_salt": f"{salt}-{j}"} for j in range(4)])
    prompt_tokens = outs[0]["usage"]["prompt_tokens"]
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    after = engine.stats().prefix
    cached = after.cached_tokens - before.cached_tokens
    # n > 1: the gateway first primes the prompt minus its last token (one Engine request of
    # prompt_tokens - 1 tokens: a prefix miss), whose checkpoint every sample then reuses.
    primed = prompt_tokens - 1 if shared else 0
    return {"wall_s": wall, "tok_per_s": tokens / wall, "prompt_tokens": prompt_tokens,
            "prefilled_tokens": primed + 4 * prompt_tokens - cached, "cached_tokens": cached,
            "prefills_from_root": after.misses - before.misses}


def _mask_us(frontend: Any, texts: list[str]) -> float:
    """Median host time of one next-token mask along the constrained answers."""
    from ninfer_jax.sampling_params import StructuredOutput

    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    times = []
    for text in texts:
        matcher = frontend.grammar().matcher(spec)
        for t in frontend.tokenizer.encode_text(text):
            start = time.perf_counter()
            matcher.mask()
            times.append(time.perf_counter() - start)
            if not matcher.advance([t]):  # re-encoded text may split differently: stop there
                break
    return 1e6 * statistics.median(times)


def _ratio_rows(pairs: list[tuple[dict, dict]], key: str) -> dict[str, float]:
    ratios = sorted(a[key] / b[key] for a, b in pairs)
    return {"median": statistics.median(ratios), "min": ratios[0], "max": ratios[-1]}


STALL_CLIENTS = 8
STALL_BYTES = (4 << 20) - 64 * 1024  # a body just under the server's 4 MiB limit


STALL_MESSAGES = 60_000


async def _stall_send(url: str, kind: str) -> dict[str, Any]:
    """STALL_CLIENTS concurrent chat requests, each a maximal legal body ("text": one message
    of about STALL_BYTES of story text; "messages": STALL_MESSAGES short messages), parsed,
    rendered and tokenized, then refused as longer than the context; encoded once before the
    clock starts."""
    import httpx

    if kind == "text":
        text = ("Once upon a time there was a little fox who liked to run. " * (
            STALL_BYTES // 60))[:STALL_BYTES - 200]
        messages = [{"role": "user", "content": text}]
    else:
        messages = [{"role": ("user", "assistant")[i % 2], "content": f"word {i}"}
                    for i in range(STALL_MESSAGES)]
    body = json.dumps({"model": MODEL, "max_tokens": 8, "messages": messages}).encode()
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(timeout=600) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(*(
            client.post(f"{url}/v1/chat/completions", content=body, headers=headers)
            for _ in range(STALL_CLIENTS)))
        wall = time.perf_counter() - start
    return {"kind": kind, "clients": STALL_CLIENTS, "body_bytes": len(body),
            "requests_s": wall, "statuses": sorted({a.status_code for a in answers})}


def _stall_sender(url: str, kind: str, queue: Any) -> None:
    queue.put(asyncio.run(_stall_send(url, kind)))


def _stall_prober(url: str, stop: Any, queue: Any) -> None:
    """Until `stop` is set, every 20 ms: `/health`, then an ordinary small request (`/tokenize`
    of a sentence); both latency lists (its own process, so neither the server's nor the
    senders' work is on its clock)."""
    import httpx

    health, small = [], []
    body = {"model": MODEL, "prompt": "Once upon a time there was a little fox."}
    with httpx.Client(timeout=30) as client:
        client.get(f"{url}/health").raise_for_status()
        while not stop.is_set():
            sent = time.perf_counter()
            client.get(f"{url}/health").raise_for_status()
            health.append(time.perf_counter() - sent)
            sent = time.perf_counter()
            client.post(f"{url}/tokenize", json=body).raise_for_status()
            small.append(time.perf_counter() - sent)
            time.sleep(0.02)
    queue.put((health, small))


def _stall_row(url: str, kind: str) -> dict[str, Any]:
    """The event-loop row (module docstring): a prober process and a sender process; prints the
    row against the target (max /health latency <= 100 ms)."""
    ctx = multiprocessing.get_context("spawn")
    stop, probes, sent = ctx.Event(), ctx.Queue(), ctx.Queue()
    prober = ctx.Process(target=_stall_prober, args=(url, stop, probes))
    prober.start()
    time.sleep(2.0)  # the prober's interpreter is up and probing
    sender = ctx.Process(target=_stall_sender, args=(url, kind, sent))
    sender.start()
    row = sent.get(timeout=1800)
    stop.set()
    health, small = (sorted(x) for x in probes.get(timeout=60))
    sender.join(60)
    prober.join(60)
    for name, latencies in (("health", health), ("small", small)):
        row.update({f"{name}_probes": len(latencies),
                    f"{name}_ms_median": 1e3 * statistics.median(latencies),
                    f"{name}_ms_p99": 1e3 * latencies[min(len(latencies) - 1,
                                                          int(0.99 * len(latencies)))],
                    f"{name}_ms_max": 1e3 * latencies[-1]})
    met = "met" if row["health_ms_max"] <= 100 else "NOT met"
    what = "one long message" if kind == "text" else f"{STALL_MESSAGES:,} messages"
    print(f"\n{row['clients']} clients x {row['body_bytes'] / 2**20:.2f} MiB chat bodies of "
          f"{what} "
          f"(statuses {row['statuses']}, {row['requests_s']:.1f} s), probed every 20 ms "
          f"before, during and after ({row['health_probes']} probes); load "
          f"{os.getloadavg()[0]:.1f}")
    for name, label in (("health", "/health"), ("small", "/tokenize, one sentence")):
        print(f"  {label:<24} median {row[f'{name}_ms_median']:.1f} ms, p99 "
              f"{row[f'{name}_ms_p99']:.1f} ms, max {row[f'{name}_ms_max']:.1f} ms")
    print(f"  target /health max <= 100 ms: {met}")
    return row


def _demo_rows() -> dict[str, Any]:
    """The JSON-schema and n = 4 rows on the embedded model (module docstring)."""
    from ninfer_jax.api import Engine

    engine = Engine.open(max_concurrency=4, max_seq_len=512)
    try:
        with ServerThread(create_app(engine, model_name=MODEL)) as server:
            _grammar_turn(server.url, True), _grammar_turn(server.url, False)  # warm-up
            pairs = []
            for _ in range(REPS):
                pairs.append((_grammar_turn(server.url, True),
                              _grammar_turn(server.url, False)))
            for with_grammar, _ in pairs:
                for text, finish in zip(with_grammar["texts"], with_grammar["finish"]):
                    ok = finish == "length" and text.startswith('{"story": "')
                    if not ok:
                        raise AssertionError(f"constrained answer breaks the schema: {text!r}")
            mask_us = _mask_us(engine.frontend, [t for a, _ in pairs for t in a["texts"]])
            _n_turn(server.url, engine, True, -1), _n_turn(server.url, engine, False, -2)
            n_pairs = [(_n_turn(server.url, engine, True, 2 * r),
                        _n_turn(server.url, engine, False, 2 * r + 1)) for r in range(REPS)]
            stall = [_stall_row(server.url, kind) for kind in ("text", "messages")]
    finally:
        engine.close()
    grammar = {"with": [a["tok_per_s"] for a, _ in pairs],
               "without": [b["tok_per_s"] for _, b in pairs],
               "ratio": _ratio_rows(pairs, "tok_per_s"), "mask_us_per_token": mask_us,
               "clients": GRAMMAR_CLIENTS, "max_tokens": MAX_TOKENS}
    n4 = {"n4": [a for a, _ in n_pairs], "separate": [b for _, b in n_pairs],
          "tok_per_s_ratio": _ratio_rows(n_pairs, "tok_per_s")}
    print(f"\nembedded demo model, {GRAMMAR_CLIENTS} concurrent greedy chat requests, "
          f"{MAX_TOKENS} new tokens, {REPS} turns each (A B A B)")
    print(f"{'row':<34} {'tok/s (median)':>15} {'ratio med [min-max]':>22}")
    r = grammar["ratio"]
    print(f"{'json_schema (response_format)':<34} {statistics.median(grammar['with']):>15.1f} "
          f"{r['median']:>9.3f} [{r['min']:.3f}-{r['max']:.3f}]")
    print(f"{'no grammar':<34} {statistics.median(grammar['without']):>15.1f}")
    print(f"host mask time per token: {mask_us:.1f} us (median)")
    r = n4["tok_per_s_ratio"]
    a, b = n_pairs[-1]
    print(f"{'n=4, one request':<34} {statistics.median(x['tok_per_s'] for x in n4['n4']):>15.1f} "
          f"{r['median']:>9.3f} [{r['min']:.3f}-{r['max']:.3f}]   prefilled "
          f"{a['prefilled_tokens']} of 4 x {a['prompt_tokens']} (cached {a['cached_tokens']}, "
          f"{a['prefills_from_root']} from root)")
    print(f"{'4 separate requests (own salts)':<34} "
          f"{statistics.median(x['tok_per_s'] for x in n4['separate']):>15.1f} "
          f"{'':>22}   prefilled {b['prefilled_tokens']} of 4 x {b['prompt_tokens']} "
          f"(cached {b['cached_tokens']}, {b['prefills_from_root']} from root)")
    return {"json_schema": {k: v for k, v in grammar.items()}, "n4": n4, "stall": stall}


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
    demo = _demo_rows()
    return {"engine": kind, "requests_per_client": REQUESTS_PER_CLIENT,
            "max_tokens": MAX_TOKENS, "levels": levels, "demo": demo}
