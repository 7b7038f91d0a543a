"""`ninfer generate` and `ninfer chat`: the Generation purpose from the command line.

Owns reading prompts (flags, a messages file, a JSONL file), streaming answers to stdout, and
progress, timing and throughput to stderr. Several prompts run concurrently through one Engine,
at most its queue capacity outstanding: the next prompt is submitted as earlier answers are
read, so a file of any length gets exactly one answer line per input line, in input order.
A JSONL line that cannot be run (not UTF-8, not JSON, not a request, refused by the Engine)
gets an `{"index", "error"}` line and the job goes on.
"""

from __future__ import annotations

import collections
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO, TextIO

from absl import app, flags

from ninfer_jax.engine import Delta, RejectedError, RequestHandle
from ninfer_jax.engine.events import Channel
from ninfer_jax.gateway.files import (
    CommandError,
    RecordError,
    check_unicode,
    decode_utf8,
    iter_lines,
    parse_record,
    read_json,
)
from ninfer_jax.program.config import MAX_SPECULATIVE_TOKENS
from ninfer_jax.sampling_params import MAX_SEED, MAX_TOP_K, SamplingParams, SamplingParamsError

if TYPE_CHECKING:
    from ninfer_jax.api import Engine

FLAGS = flags.FLAGS
flags.DEFINE_multi_string("prompt", [], "generate: a raw prompt, continued as given (no chat "
                          "template; repeat the flag for several)")
flags.DEFINE_string("messages", None, "generate: a JSON file with a list of chat messages "
                    "(rendered with the chat template, as `ninfer chat` does)")
flags.DEFINE_multi_string("image", [], "generate: an image file for the prompt (a vision model; "
                          "repeat for several): each --prompt becomes a chat message holding "
                          "the images, then its text")
flags.DEFINE_string("input_jsonl", None,
                    "generate: a JSONL file, one request per line: {\"prompt\": ...} or "
                    "{\"messages\": [...]}; answers go to stdout as JSONL")
flags.DEFINE_integer("max_new_tokens", 256, "generation budget per request", lower_bound=1)
flags.DEFINE_float("temperature", 0.8, "0 = greedy")
flags.DEFINE_float("top_p", 0.95, "nucleus sampling mass (1 = off)")
flags.DEFINE_integer("top_k", 0, "keep the k most likely tokens (0 = off)", lower_bound=0,
                     upper_bound=MAX_TOP_K)
flags.DEFINE_float("min_p", 0.0, "drop tokens below min_p * p_max (0 = off)")
flags.DEFINE_float("presence_penalty", 0.0, "OpenAI presence penalty")
flags.DEFINE_float("frequency_penalty", 0.0, "OpenAI frequency penalty")
flags.DEFINE_float("repetition_penalty", 1.0, "Hugging Face repetition penalty (1 = off)")
flags.DEFINE_integer("seed", None, "sampling seed (default: a fresh one per request)",
                     lower_bound=0, upper_bound=MAX_SEED)
flags.DEFINE_multi_string("stop", [], "stop string (repeat the flag for several)")
flags.DEFINE_integer("max_concurrency", 4, "requests decoding together", lower_bound=1,
                     upper_bound=64)
flags.DEFINE_integer("max_seq_len", 2048, "prompt + generated tokens per request", lower_bound=2)
flags.DEFINE_enum("enable_thinking", None, ["true", "false"], "chat template thinking switch")
flags.DEFINE_integer("max_thinking_tokens", None, "thinking budget: after this many thinking "
                     "tokens the block is closed and the answer follows", lower_bound=1)
flags.DEFINE_enum("kv_dtype", "auto", ["auto", "int8"], "generate, chat, serve, plan: the K/V "
                  "pages; auto: in --dtype; int8: INT8 with a scale per token and kv head "
                  "(about half the bytes of bf16 pages)")
flags.DEFINE_bool("prefix_reuse", True, "reuse prefix checkpoints (--noprefix_reuse: recompute)")
flags.DEFINE_enum("speculative", "off", ["off", "mtp", "dflash"],
                  "generate, chat, serve: speculative decoding with the model's MTP head "
                  "(mtp) or a DFlash block drafter (dflash)")
flags.DEFINE_integer("num_speculative_tokens", None,
                     "generate, chat, serve: drafts per round (mtp: 1..5, default 1; dflash: "
                     "1..15, default 8)", lower_bound=1, upper_bound=15)
flags.DEFINE_enum("draft_head", None, ["full", "selector"],
                  "generate, chat, serve: with --speculative=dflash, what turns a block into "
                  "drafts: the full lm-head proposal (default) or the drafter's candidate "
                  "selector")
flags.DEFINE_enum("draft_policy", None, ["adaptive", "fixed"],
                  "generate, chat, serve: with --speculative, how a round's draft count is "
                  "chosen: adaptive (default: 0..K by measured step times and acceptance) or "
                  "fixed (always K)")
flags.DEFINE_string("drafter", None, "generate, chat, serve: the DFlash drafter with "
                    "--speculative=dflash (a checkpoint directory; default: the model's "
                    "drafter/ directory, or the embedded model's shipped drafter); convert: a "
                    "DFlash drafter checkpoint the artifact carries under drafter/")
flags.DEFINE_string("context_store", None,
                    "generate, chat, serve: a JSON file with the context store's topology "
                    "(prefix checkpoints beyond the device), or 'off'; default: a host-memory "
                    "tier of --host_cache_gb")
flags.DEFINE_float("host_cache_gb", None, "generate, chat, serve: host-memory tier of the "
                   "context store in GiB (default 1; 0: none)", lower_bound=0)
flags.DEFINE_string("disk_cache_dir", None, "generate, chat, serve: a local-disk tier of the "
                    "context store under this directory (kept across restarts)")
flags.DEFINE_string("redis_url", None, "generate, chat, serve: a Redis tier of the context "
                    "store (redis://host:port/db), shared by every engine using it")
flags.DEFINE_bool("stats", False, "generate: print the Engine's statistics (speculative "
                  "acceptance, prefix hits) to stderr at the end")


def _sampling() -> SamplingParams:
    try:
        check_unicode(FLAGS.stop, "--stop")
        return SamplingParams(
            max_new_tokens=FLAGS.max_new_tokens, temperature=FLAGS.temperature,
            top_p=FLAGS.top_p, top_k=FLAGS.top_k, min_p=FLAGS.min_p,
            presence_penalty=FLAGS.presence_penalty, frequency_penalty=FLAGS.frequency_penalty,
            repetition_penalty=FLAGS.repetition_penalty, seed=FLAGS.seed, stop=tuple(FLAGS.stop),
            max_thinking_tokens=FLAGS.max_thinking_tokens)
    except (SamplingParamsError, RecordError) as e:
        raise app.UsageError(str(e)) from None  # the message names the field, as the flag


def _thinking() -> bool | None:
    return None if FLAGS.enable_thinking is None else FLAGS.enable_thinking == "true"


def parallel_settings() -> dict:
    """The Engine's tensor-parallel setting from --tensor_parallel. On CPU the process is given
    that many host devices (before jax starts its backend), so the split runs anywhere."""
    if FLAGS.tensor_parallel == 1:
        return {}
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", FLAGS.tensor_parallel)
    except RuntimeError:  # the backend has started: the devices it has are what there is
        pass
    return {"tensor_parallel": FLAGS.tensor_parallel}


def speculative_settings() -> dict:
    """The Engine's speculative settings from --speculative and --num_speculative_tokens."""
    for name in ("drafter", "draft_head"):
        if getattr(FLAGS, name) is not None and FLAGS.speculative != "dflash":
            raise app.UsageError(f"--{name} needs --speculative=dflash")
    if FLAGS.speculative == "off":
        for name in ("num_speculative_tokens", "draft_policy"):
            if getattr(FLAGS, name) is not None:
                raise app.UsageError(f"--{name} needs --speculative=mtp or dflash")
        return {}
    settings = {"speculative": FLAGS.speculative}
    if FLAGS.num_speculative_tokens is not None:
        top = MAX_SPECULATIVE_TOKENS[FLAGS.speculative]
        if FLAGS.num_speculative_tokens > top:
            raise app.UsageError(f"--num_speculative_tokens={FLAGS.num_speculative_tokens}: "
                                 f"with --speculative={FLAGS.speculative} it must be in 1..{top}")
        settings["num_speculative_tokens"] = FLAGS.num_speculative_tokens
    if FLAGS.drafter is not None:
        settings["drafter"] = FLAGS.drafter
    if FLAGS.draft_head is not None:
        settings["draft_head"] = FLAGS.draft_head
    if FLAGS.draft_policy is not None:
        settings["draft_policy"] = FLAGS.draft_policy
    return settings


def store_settings() -> dict:
    """The Engine's context store settings from --context_store and its shortcuts."""
    shortcuts = {k: getattr(FLAGS, k) for k in ("host_cache_gb", "disk_cache_dir", "redis_url")
                 if getattr(FLAGS, k) is not None}
    if FLAGS.context_store is not None:
        if shortcuts:
            raise app.UsageError(f"--context_store describes the whole topology; drop "
                                 f"{', '.join('--' + k for k in shortcuts)}")
        return {"context_store": FLAGS.context_store}
    return shortcuts


def _open_engine():
    from ninfer_jax.api import Engine

    start = time.perf_counter()
    engine = Engine.open(FLAGS.model, max_concurrency=FLAGS.max_concurrency,
                         max_seq_len=FLAGS.max_seq_len, dtype=FLAGS.dtype,
                         prefix_reuse=FLAGS.prefix_reuse, verify_weights=FLAGS.verify_weights,
                         kv_dtype=FLAGS.kv_dtype, quantize=FLAGS.quantize,
                         **speculative_settings(),
                         **parallel_settings(), **store_settings())
    print(f"[ninfer] model {engine.model_path} ready in {time.perf_counter() - start:.1f}s "
          f"({engine.describe()})", file=sys.stderr)
    return engine


def jsonl_request(line: bytes) -> dict[str, Any]:
    """One `--input_jsonl` line as `{"prompt"}` or `{"messages"}`; RecordError naming why not."""
    record = parse_record(line)
    if ("prompt" in record) == ("messages" in record):
        raise RecordError('a request needs exactly one of "prompt" and "messages"')
    key = "prompt" if "prompt" in record else "messages"
    if not isinstance(record[key], str if key == "prompt" else list):
        raise RecordError(f"{key!r} must be {'a string' if key == 'prompt' else 'a list'}")
    check_unicode(record[key], key)
    return {key: record[key]}


def _jsonl_requests(lines: Iterable[tuple[int, bytes]]
                    ) -> Iterator[tuple[int, dict[str, Any] | str]]:
    for index, line in lines:
        try:
            yield index, jsonl_request(line)
        except RecordError as e:
            yield index, str(e)


def _requests() -> tuple[Iterable[tuple[int, dict[str, Any] | str]], bool]:
    """(index, request or why it cannot run) in input order, and whether answers are JSONL."""
    if FLAGS.input_jsonl:
        return _jsonl_requests(iter_lines("input_jsonl", FLAGS.input_jsonl)), True
    if FLAGS.messages:
        messages = read_json("messages", FLAGS.messages)
        if not isinstance(messages, list):
            raise CommandError(f"--messages {FLAGS.messages!r} must hold a JSON list of messages")
        return [(0, {"messages": messages})], False
    if not FLAGS.prompt:
        raise app.UsageError("generate needs --prompt=TEXT, --messages=FILE or --input_jsonl=FILE")
    try:
        check_unicode(FLAGS.prompt, "--prompt")
    except RecordError as e:
        raise app.UsageError(f"{e} (the command line is not UTF-8)") from None
    if FLAGS.image:
        images = [{"type": "image", "image": path} for path in FLAGS.image]
        return [(i, {"messages": [{"role": "user", "content": [
            *images, {"type": "text", "text": p}]}]}) for i, p in enumerate(FLAGS.prompt)], False
    return [(i, {"prompt": p}) for i, p in enumerate(FLAGS.prompt)], False


def _submit(submit: Callable[[Any], RequestHandle], request: Any) -> RequestHandle | str:
    """The request's handle, or why it was not accepted."""
    if isinstance(request, str):
        return request
    try:
        return submit(request)
    except RejectedError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - the Frontend refusing this input only
        return f"{type(e).__name__}: {e}"


def submit_windowed(capacity: int, items: Iterable[tuple[int, Any]],
                    submit: Callable[[Any], RequestHandle]
                    ) -> Iterator[tuple[int, RequestHandle | str]]:
    """Submits `(index, request)` items in order and yields `(index, handle)`, or `(index,
    reason)` for one not accepted, in input order, with at most `capacity` handles outstanding.
    The next item is submitted only when the caller asks for the next answer, so it must have
    consumed the handle it was given (read to its end, or released) by then. An item whose
    request is a string is a reason already: it is yielded in its place, never submitted."""
    window: collections.deque[tuple[int, RequestHandle | str]] = collections.deque()
    outstanding = 0
    for index, request in items:
        while outstanding >= capacity:
            done = window.popleft()
            outstanding -= isinstance(done[1], RequestHandle)
            yield done
        outcome = _submit(submit, request)
        outstanding += isinstance(outcome, RequestHandle)
        window.append((index, outcome))
    yield from window


def _stream(handle, out: TextIO) -> Any:
    """Writes a request's content deltas to `out` (thinking to stderr) as they are committed."""
    for event in handle:
        if isinstance(event, Delta) and event.text:
            target = sys.stderr if event.channel is Channel.THINKING else out
            target.write(event.text)
            target.flush()
    return handle.result()


def _answer_line(index: int, outcome: RequestHandle | str) -> tuple[str, Any]:
    """The JSONL answer of one request and its result (None when it was not accepted)."""
    if isinstance(outcome, str):
        return json.dumps({"index": index, "error": outcome}), None
    r = outcome.result()
    return json.dumps({"index": index, "text": r.text, "reasoning": r.reasoning_text,
                       "finish_reason": r.finish_reason.value,
                       "completion_tokens": r.usage.completion_tokens, "error": r.error}), r


def stats_line(stats: Any) -> str:
    """One line of Engine statistics for `--stats`."""
    spec, prefix = stats.speculative, stats.prefix
    line = (f"[ninfer] stats: generated {stats.generated_tokens} tokens, finished "
            f"{stats.finished_requests} requests, prefix hits {prefix.hits} misses {prefix.misses}")
    if spec.num_speculative_tokens:
        by_position = ", ".join(f"{a:.2f}" for a in spec.acceptance_by_position)
        line += (f"; speculative {spec.method} K={spec.num_speculative_tokens}: "
                 f"{spec.verify_rows} verify rows,"
                 f" mean accepted tokens {spec.mean_accepted_tokens:.2f}, acceptance by "
                 f"position [{by_position}]")
        if spec.policy == "adaptive":
            chosen = ", ".join(f"{k}: {n}" for k, n in spec.rounds_by_drafts)
            line += f", rounds by K {{{chosen}}}, estimated gain {spec.estimated_gain:.2f}x"
    else:
        line += "; speculative off"
    t = stats.tiers
    if t.tiers:
        hits = ", ".join(f"{tier} {n}" for tier, n in t.hits_by_tier)
        line += (f"; context store {'->'.join(t.tiers)}: {t.offloads} checkpoints written "
                 f"({t.bytes_written} bytes), {t.reloads} reloaded [{hits}]")
        line += "".join(f", {n} damaged files quarantined by {tier}"
                        for tier, n in t.quarantined_by_tier if n)
    return line


def run_generate() -> int:
    requests, as_jsonl = _requests()
    sampling, thinking = _sampling(), _thinking()
    headers = not as_jsonl and len(FLAGS.prompt) > 1
    results, total = [], 0
    with _open_engine() as engine:
        start = time.perf_counter()

        def submit(req: dict[str, Any]) -> RequestHandle:
            return engine.submit(req.get("prompt"), messages=req.get("messages"),
                                 sampling=sampling, enable_thinking=thinking)

        for index, outcome in submit_windowed(engine.stats().capacity, requests, submit):
            total += 1
            if as_jsonl:
                line, r = _answer_line(index, outcome)
                print(line, flush=True)
            elif isinstance(outcome, str):
                print(f"[ninfer] request {index} rejected: {outcome}", file=sys.stderr)
                r = None
            else:
                if headers:
                    print(f"--- [{index}] {FLAGS.prompt[index]}", flush=True)
                r = _stream(outcome, sys.stdout)
                print(flush=True)
            if r is not None:
                results.append(r)
        elapsed = time.perf_counter() - start
        if FLAGS.stats:
            print(stats_line(engine.stats()), file=sys.stderr)
    tokens = sum(r.usage.completion_tokens for r in results)
    cached = sum(r.usage.cached_tokens for r in results)
    print(f"[ninfer] {len(results)} requests, {tokens} tokens in {elapsed:.2f}s "
          f"({tokens / max(elapsed, 1e-9):.1f} tok/s), prefix-hit tokens {cached}",
          file=sys.stderr)
    failed = total - sum(r.error is None for r in results)
    if failed:
        raise CommandError(f"{failed} of {total} requests failed")
    return 0


def run_chat(stdin: BinaryIO | None = None) -> int:
    """Interactive multi-turn chat; `/reset` clears the history, `/image PATH` attaches an
    image to the next message (a vision model), `/exit` or EOF ends. A turn that cannot run
    (not UTF-8, refused by the Engine) is reported and skipped; the chat ends with a
    CommandError when any turn failed."""
    stdin = sys.stdin.buffer if stdin is None else stdin
    interactive = stdin.isatty()  # the "> " prompt only for a person at a terminal
    sampling = _sampling()
    history: list[dict[str, Any]] = []
    images: list[dict[str, str]] = []  # attached to the next message
    failed = 0
    with _open_engine() as engine:
        print("[ninfer] chat: type a message; /image PATH attaches an image, /reset clears "
              "history, /exit quits", file=sys.stderr)
        while True:
            if interactive:
                print("> ", end="", file=sys.stderr, flush=True)
            raw = stdin.readline()
            if interactive and not raw:
                print(file=sys.stderr)  # end the prompt's line at EOF (Ctrl-D)
            try:
                line = decode_utf8(raw, "the message", RecordError)
            except RecordError as e:
                print(f"[ninfer] rejected: {e}", file=sys.stderr)
                failed += 1
                continue
            if not line or line.strip() == "/exit":
                break
            if line.strip() == "/reset":
                history.clear()
                images.clear()
                continue
            if line.startswith("/image"):
                path = line[len("/image"):].strip()
                if not path:
                    print("[ninfer] usage: /image PATH", file=sys.stderr)
                    continue
                images.append({"type": "image", "image": path})
                print(f"[ninfer] {path} attached to the next message", file=sys.stderr)
                continue
            if not line.strip():
                continue
            text = line.rstrip("\n")
            content = [*images, {"type": "text", "text": text}] if images else text
            images = []
            history.append({"role": "user", "content": content})
            if not _chat_turn(engine, history, sampling):
                history.pop()
                failed += 1
    if failed:
        raise CommandError(f"{failed} chat turn(s) failed")
    return 0


def _chat_turn(engine: Engine, history: list[dict[str, Any]], sampling: SamplingParams) -> bool:
    """Runs one turn, streaming the answer; appends it to `history`. False if it failed."""
    start = time.perf_counter()
    outcome = _submit(lambda msgs: engine.submit(messages=msgs, sampling=sampling,
                                                 enable_thinking=_thinking()), history)
    if isinstance(outcome, str):
        print(f"[ninfer] rejected: {outcome}", file=sys.stderr)
        return False
    first = None
    for event in outcome:
        if isinstance(event, Delta) and event.text:
            first = first or time.perf_counter()
            target = sys.stderr if event.channel is Channel.THINKING else sys.stdout
            target.write(event.text)
            target.flush()
    r = outcome.result()
    print(flush=True)
    elapsed = time.perf_counter() - start
    ttft = (first or time.perf_counter()) - start
    print(f"[ninfer] {r.usage.completion_tokens} tokens, TTFT {ttft:.2f}s, "
          f"{r.usage.completion_tokens / max(elapsed, 1e-9):.1f} tok/s, "
          f"cached {r.usage.cached_tokens}, finish {r.finish_reason.value}", file=sys.stderr)
    if r.error is not None:
        print(f"[ninfer] failed: {r.error}", file=sys.stderr)
        return False
    history.append({"role": "assistant", "content": r.text})
    return True
