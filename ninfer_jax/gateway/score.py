"""`ninfer score`: batch causal-scoring jobs (JSONL in, JSONL out) and corpus perplexity.

    ninfer score --input=IN.jsonl --output=OUT.jsonl [--text_field=text] [--context_field=F]
                 [--window=N --stride=S] [--model=DIR]
    ninfer score --perplexity=FILE.txt [--window=N --stride=S] [--model=DIR]

Owns reading records, writing results, the progress bar (stderr) and resumption. Output line i
answers input line i: `{"index", "num_tokens", "sum_logprob", "is_greedy", "token_logprobs"}`,
or `{"index", "error"}` for a bad record (not UTF-8, not JSON, missing or empty field, invalid
Unicode, too long without a window), and the job goes on. The input is read as bytes and each
line decoded on its own; every failure to prepare one record is caught for that record alone.
A record's field may hold text or a list of token ids.

Resumable and crash-safe: results are appended in input order as complete lines, flushed and
fsynced after every chunk of records. The job's identity (input digest, model digest, settings)
is in a job file beside the output (`gateway/resume.py`); a restart of the same job cuts a torn
last line, keeps every complete one and resumes at the first missing record, and a restart of
another job is refused. Chunks are fixed runs of `--chunk_records` records counted from the
start of the input, and a resumed run recomputes the whole chunk it resumes in, so its numbers
are bit-identical to an uninterrupted run's.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from typing import Any

from absl import app, flags

from ninfer_jax.gateway.files import (
    CommandError,
    RecordError,
    check_unicode,
    iter_lines,
    os_reason,
    parse_record,
    read_text,
)
from ninfer_jax.program.config import resolve_dtype

FLAGS = flags.FLAGS
flags.DEFINE_string("input", None, "score: JSONL file of records to score")
flags.DEFINE_string("output", None, "score: JSONL file of results (resumed if it exists)")
flags.DEFINE_string("text_field", "text", "score: record field with the text (or token ids)")
flags.DEFINE_string("context_field", None,
                    "score: record field with a context (text or token ids); only the text "
                    "after it is scored; a record without the field has no context")
flags.DEFINE_integer("window", None, "score: rolling window in tokens (default: no rolling)",
                     lower_bound=1)
flags.DEFINE_integer("stride", None, "score: new tokens scored per later window (default: window)",
                     lower_bound=1)
flags.DEFINE_integer("max_len", None, "score: longest window without --window (default: the "
                     "model's limit, at most 2048)", lower_bound=1)
flags.DEFINE_integer("max_batch_tokens", 4096, "score: tokens per device call", lower_bound=1)
flags.DEFINE_integer("chunk_records", 64, "score: records per fsynced output chunk",
                     lower_bound=1)
flags.DEFINE_string("perplexity", None, "score: print the corpus perplexity of this text file")

# Every flag that changes a job's results: recorded in its job file, checked on resume.
RESULT_FLAGS = ("text_field", "context_field", "window", "stride", "max_len", "max_batch_tokens",
                "dtype", "chunk_records")
_INT64 = 1 << 63


def _open_scorer():
    from ninfer_jax.scoring import Scorer

    start = time.perf_counter()
    config = {"window": FLAGS.window, "stride": FLAGS.stride, "max_len": FLAGS.max_len,
              "max_batch_tokens": FLAGS.max_batch_tokens,
              "dtype": resolve_dtype(FLAGS.dtype)}
    scorer = Scorer.open(FLAGS.model, verify_weights=FLAGS.verify_weights, **config)
    print(f"[ninfer] scoring {scorer.model_path}: windows {scorer.core.keys()} compiled in "
          f"{time.perf_counter() - start:.1f}s", file=sys.stderr)
    return scorer


def _field(record: dict[str, Any], name: str) -> Any:
    """A text (valid Unicode) or a list of integer token ids; RecordError otherwise."""
    value = record[name]
    if isinstance(value, str):
        check_unicode(value, repr(name))
    elif isinstance(value, list):
        if not all(isinstance(t, int) and not isinstance(t, bool) and -_INT64 <= t < _INT64
                   for t in value):
            raise RecordError(f"{name!r} must hold integer token ids")
    else:
        raise RecordError(f"{name!r} must be a string or a list of token ids")
    return value


def _item(scorer, line: bytes):
    """A checked ScoreRequest for one input line; raises RecordError or ScoreInputError."""
    from ninfer_jax.scoring import ScoreInputError

    record = parse_record(line)
    if FLAGS.text_field not in record:
        raise ScoreInputError(f"missing field {FLAGS.text_field!r}")
    value = _field(record, FLAGS.text_field)
    context = None  # absent or null: none
    if FLAGS.context_field and record.get(FLAGS.context_field) is not None:
        context = _field(record, FLAGS.context_field)
    if isinstance(value, str):
        if not value:
            raise ScoreInputError(f"empty {FLAGS.text_field!r}")
        return scorer.request(text=value, context=context)
    return scorer.request(token_ids=value, context=context)


def _prepare(scorer, line: bytes) -> Any:
    """The record's ScoreRequest, or the reason it cannot be scored. Preparing a record touches
    no shared state, so any failure in it is that record's alone and never stops the job."""
    from ninfer_jax.scoring import ScoreInputError

    try:
        return _item(scorer, line)
    except (RecordError, ScoreInputError) as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - e.g. a tokenizer refusing this record's text
        return f"{type(e).__name__}: {e}"


def _score_chunk(scorer, chunk: list[tuple[int, bytes]]) -> tuple[list[dict[str, Any]], int]:
    """Result records of one chunk, in order, and the number of tokens scored."""
    answers: dict[int, dict[str, Any]] = {}
    requests, indices = [], []
    for index, line in chunk:
        prepared = _prepare(scorer, line)
        if isinstance(prepared, str):
            answers[index] = {"index": index, "error": prepared}
        else:
            requests.append(prepared)
            indices.append(index)
    results = scorer.score_requests(requests)
    for index, r in zip(indices, results):
        answers[index] = {"index": index, "num_tokens": r.num_tokens,
                          "sum_logprob": r.sum_logprob, "is_greedy": r.is_greedy,
                          "token_logprobs": [float(x) for x in r.token_logprobs]}
    return [answers[i] for i, _ in chunk], sum(r.num_tokens for r in results)


def _identity():
    from ninfer_jax.artifact.hf import checkpoint_dir
    from ninfer_jax.gateway.resume import job_identity
    from ninfer_jax.loader import DEFAULT_MODEL

    model_dir = checkpoint_dir(DEFAULT_MODEL if FLAGS.model is None else FLAGS.model)
    settings = {f: FLAGS[f].value for f in RESULT_FLAGS}
    settings["dtype"] = resolve_dtype(settings["dtype"])  # what ran, not "auto"
    return job_identity(FLAGS.input, model_dir, settings)


def run_score() -> int:
    from ninfer_jax.gateway.resume import prepare_output

    if FLAGS.perplexity:
        return _run_perplexity()
    if not FLAGS.input or not FLAGS.output:
        raise app.UsageError("score needs --input=FILE.jsonl and --output=FILE.jsonl "
                             "(or --perplexity=FILE.txt)")
    from tqdm import tqdm

    identity = _identity()
    total = identity.num_records
    done = prepare_output(FLAGS.output, identity)
    if done == total:
        print(f"[ninfer] {FLAGS.output} is complete ({total} records)", file=sys.stderr)
        return 0
    scorer = _open_scorer()
    resume = done - done % FLAGS.chunk_records  # recompute the chunk we resume in
    errors = tokens = 0
    start = time.perf_counter()
    bar = tqdm(total=total, initial=done, unit="rec", file=sys.stderr, dynamic_ncols=True)
    with bar, _open_output() as out:  # the bar ends its line before any error line
        chunk: list[tuple[int, bytes]] = []
        for index, line in iter_lines("input", FLAGS.input):
            if index < resume:
                continue
            chunk.append((index, line))
            if len(chunk) == FLAGS.chunk_records or index == total - 1:
                answers, n = _score_chunk(scorer, chunk)
                new = [a for a in answers if a["index"] >= done]
                _append(out, "".join(json.dumps(a) + "\n" for a in new).encode())
                errors += sum("error" in a for a in new)
                tokens += n
                bar.update(len(new))
                bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}",
                                errors=errors)
                chunk = []
    print(f"[ninfer] {total - done} records ({errors} errors), {tokens} tokens in "
          f"{time.perf_counter() - start:.1f}s -> {FLAGS.output}", file=sys.stderr)
    return 0


def _open_output():
    """The output, unbuffered: bytes reach the file in `_append` or not at all, never later
    (a buffer flushed at close would fail a second time on a full disk)."""
    try:
        return open(FLAGS.output, "ab", buffering=0)
    except OSError as e:
        raise CommandError(f"--output {FLAGS.output!r}: cannot write: {os_reason(e)}") from None


def _append(out, data: bytes) -> None:
    """Appends whole lines and makes them durable; a full disk is a CommandError (a later run
    cuts the torn line it may leave and resumes)."""
    try:
        view = memoryview(data)
        while view:
            view = view[out.write(view):]
        os.fsync(out.fileno())
    except OSError as e:
        raise CommandError(f"--output {FLAGS.output!r}: cannot write: {os_reason(e)}") from None


def _run_perplexity() -> int:
    text = read_text("perplexity", FLAGS.perplexity)
    scorer = _open_scorer()
    start = time.perf_counter()
    [result] = scorer.rolling([text])
    if result.num_tokens == 0:
        raise CommandError(f"--perplexity {FLAGS.perplexity!r}: nothing to score (a text needs "
                           "at least two tokens)")
    elapsed = time.perf_counter() - start
    nll = -result.sum_logprob
    report = {
        "file": FLAGS.perplexity, "num_tokens": result.num_tokens,
        "perplexity": math.exp(nll / result.num_tokens),
        "word_perplexity": math.exp(nll / len(re.split(r"\s+", text.strip()))),
        "bits_per_byte": nll / math.log(2) / len(text.encode("utf-8")),
        "window": scorer.core.window, "stride": scorer.core.stride or scorer.core.window,
    }
    print(f"[ninfer] {result.num_tokens} tokens in {elapsed:.1f}s "
          f"({result.num_tokens / elapsed:.0f} tok/s)", file=sys.stderr)
    print(json.dumps(report))
    return 0
