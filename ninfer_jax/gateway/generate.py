"""`ninfer generate` and `ninfer chat`: the Generation purpose from the command line.

Owns reading prompts (flags, a messages file, a JSONL file), streaming answers to stdout, and
progress, timing and throughput to stderr. Several prompts run concurrently through one Engine.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from absl import app, flags

from ninfer_jax.engine import Delta, RejectedError
from ninfer_jax.engine.events import Channel
from ninfer_jax.sampling_params import SamplingParams, SamplingParamsError

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("prompt", [], "generate: a prompt (repeat the flag for several)")
flags.DEFINE_string("messages", None, "generate: a JSON file with a list of chat messages")
flags.DEFINE_string("input_jsonl", None,
                    "generate: a JSONL file, one request per line: {\"prompt\": ...} or "
                    "{\"messages\": [...]}; answers go to stdout as JSONL")
flags.DEFINE_integer("max_new_tokens", 256, "generation budget per request")
flags.DEFINE_float("temperature", 0.8, "0 = greedy")
flags.DEFINE_float("top_p", 0.95, "nucleus sampling mass (1 = off)")
flags.DEFINE_integer("top_k", 0, "keep the k most likely tokens (0 = off)")
flags.DEFINE_float("min_p", 0.0, "drop tokens below min_p * p_max (0 = off)")
flags.DEFINE_float("presence_penalty", 0.0, "OpenAI presence penalty")
flags.DEFINE_float("frequency_penalty", 0.0, "OpenAI frequency penalty")
flags.DEFINE_float("repetition_penalty", 1.0, "Hugging Face repetition penalty (1 = off)")
flags.DEFINE_integer("seed", None, "sampling seed (default: a fresh one per request)")
flags.DEFINE_multi_string("stop", [], "stop string (repeat the flag for several)")
flags.DEFINE_integer("max_concurrency", 4, "requests decoding together")
flags.DEFINE_integer("max_seq_len", 2048, "prompt + generated tokens per request")
flags.DEFINE_enum("enable_thinking", None, ["true", "false"], "chat template thinking switch")
flags.DEFINE_bool("prefix_reuse", True, "reuse prefix checkpoints (--noprefix_reuse: recompute)")


def _sampling() -> SamplingParams:
    try:
        return SamplingParams(
            max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
            top_p=FLAGS.top_p, top_k=FLAGS.top_k, min_p=FLAGS.min_p,
            presence_penalty=FLAGS.presence_penalty, frequency_penalty=FLAGS.frequency_penalty,
            repetition_penalty=FLAGS.repetition_penalty, seed=FLAGS.seed, stop=tuple(FLAGS.stop))
    except SamplingParamsError as e:
        raise app.UsageError(str(e)) from None  # the message names the field, as the flag


def _thinking() -> bool | None:
    return None if FLAGS.enable_thinking is None else FLAGS.enable_thinking == "true"


def _open_engine():
    from ninfer_jax.api import Engine

    start = time.perf_counter()
    engine = Engine.open(FLAGS.model, max_concurrency=FLAGS.max_concurrency,
                         max_seq_len=FLAGS.max_seq_len, dtype=FLAGS.dtype,
                         prefix_reuse=FLAGS.prefix_reuse, verify_weights=FLAGS.verify_weights)
    print(f"[ninfer] model {engine.model_path} ready in {time.perf_counter() - start:.1f}s "
          f"(max_concurrency={FLAGS.max_concurrency})", file=sys.stderr)
    return engine


def _requests() -> tuple[list[dict[str, Any]], bool]:
    """The requests to run and whether answers are printed as JSONL."""
    if FLAGS.input_jsonl:
        reqs = []
        with open(FLAGS.input_jsonl) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        reqs.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise app.UsageError(f"--input_jsonl line {n}: {e}") from None
        return reqs, True
    if FLAGS.messages:
        with open(FLAGS.messages) as f:
            return [{"messages": json.load(f)}], False
    if not FLAGS.prompt:
        raise app.UsageError("generate needs --prompt=TEXT, --messages=FILE or --input_jsonl=FILE")
    return [{"prompt": p} for p in FLAGS.prompt], False


def _stream(handle, out: TextIO) -> Any:
    """Writes a request's content deltas to `out` (thinking to stderr) as they are committed."""
    for event in handle:
        if isinstance(event, Delta) and event.text:
            target = sys.stderr if event.channel is Channel.THINKING else out
            target.write(event.text)
            target.flush()
    return handle.result()


def run_generate() -> int:
    reqs, as_jsonl = _requests()
    sampling = _sampling()
    with _open_engine() as engine:
        start = time.perf_counter()
        handles = []
        for i, req in enumerate(reqs):
            try:
                handles.append(engine.submit(
                    req.get("prompt"), messages=req.get("messages"), sampling=sampling,
                    enable_thinking=_thinking()))
            except RejectedError as e:
                print(f"[ninfer] request {i} rejected: {e}", file=sys.stderr)
                handles.append(None)
        results = []
        for i, h in enumerate(handles):
            if h is None:
                results.append(None)
                continue
            if as_jsonl:
                r = h.result()
                print(json.dumps({"index": i, "text": r.text, "reasoning": r.reasoning_text,
                                  "finish_reason": r.finish_reason.value,
                                  "completion_tokens": r.usage.completion_tokens,
                                  "error": r.error}), flush=True)
            else:
                if len(handles) > 1:
                    print(f"--- [{i}] {reqs[i].get('prompt', '(messages)')}", flush=True)
                r = _stream(h, sys.stdout)
                print(flush=True)
            results.append(r)
        elapsed = time.perf_counter() - start
    done = [r for r in results if r is not None]
    tokens = sum(r.usage.completion_tokens for r in done)
    cached = sum(r.usage.cached_tokens for r in done)
    print(f"[ninfer] {len(done)} requests, {tokens} tokens in {elapsed:.2f}s "
          f"({tokens / max(elapsed, 1e-9):.1f} tok/s), prefix-hit tokens {cached}",
          file=sys.stderr)
    return 0 if len(done) == len(results) and all(r.error is None for r in done) else 1


def run_chat(stdin: TextIO = sys.stdin) -> int:
    """Interactive multi-turn chat; `/reset` clears the history, `/exit` or EOF ends."""
    sampling = _sampling()
    history: list[dict[str, str]] = []
    with _open_engine() as engine:
        print("[ninfer] chat: type a message; /reset clears history, /exit quits", file=sys.stderr)
        while True:
            print("> ", end="", file=sys.stderr, flush=True)
            line = stdin.readline()
            if not line or line.strip() == "/exit":
                return 0
            if line.strip() == "/reset":
                history.clear()
                continue
            if not line.strip():
                continue
            history.append({"role": "user", "content": line.rstrip("\n")})
            start = time.perf_counter()
            try:
                handle = engine.submit(messages=history, sampling=sampling,
                                       enable_thinking=_thinking())
            except RejectedError as e:
                history.pop()
                print(f"[ninfer] rejected: {e}", file=sys.stderr)
                continue
            first = None
            for event in handle:
                if isinstance(event, Delta) and event.text:
                    first = first or time.perf_counter()
                    target = sys.stderr if event.channel is Channel.THINKING else sys.stdout
                    target.write(event.text)
                    target.flush()
            r = handle.result()
            print(flush=True)
            history.append({"role": "assistant", "content": r.text})
            elapsed = time.perf_counter() - start
            ttft = (first or time.perf_counter()) - start
            print(f"[ninfer] {r.usage.completion_tokens} tokens, TTFT {ttft:.2f}s, "
                  f"{r.usage.completion_tokens / max(elapsed, 1e-9):.1f} tok/s, "
                  f"cached {r.usage.cached_tokens}, finish {r.finish_reason.value}",
                  file=sys.stderr)
