"""`ninfer score`: batch causal-scoring jobs (JSONL in, JSONL out) and corpus perplexity.

    ninfer score --input=IN.jsonl --output=OUT.jsonl [--text_field=text] [--context_field=F]
                 [--window=N --stride=S] [--model=DIR]
    ninfer score --perplexity=FILE.txt [--window=N --stride=S] [--model=DIR]
    ninfer score --input=IN.jsonl --output=OUT.jsonl --num_processes=N --process_id=P
                 --coordinator=HOST:PORT   (one command per process, the same flags otherwise)

Owns the command's flags and its messages; the job itself (records, results, resumption) is
`gateway/score_job.py`, a job split across processes `gateway/score_parts.py`. Output line i
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

With --num_processes=N > 1 the N processes join through `jax.distributed` at --coordinator
(process 0's address; process 0 serves it), each scores its chunks (chunk c: process c % N) on its
own devices into a part file, and process 0 merges the parts: the output is byte-identical to a
one-process run's. Restart every process with the same command to resume.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from typing import Any

from absl import app, flags

from ninfer_jax.gateway import score_job, score_records
from ninfer_jax.gateway.files import CommandError, read_text
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
flags.DEFINE_bool("pack", True, "score: put short texts several to a window row")
flags.DEFINE_bool("share_contexts", True, "score: score a context shared by several records of "
                  "a chunk once")
flags.DEFINE_integer("chunk_records", score_records.CHUNK_RECORDS,
                     "score: records per chunk (scored together, fsynced, recomputed on resume)",
                     lower_bound=1)
flags.DEFINE_string("perplexity", None, "score: print the corpus perplexity of this text file")
flags.DEFINE_integer("num_processes", 1, "score: processes sharing the job through "
                     "jax.distributed (1: no jax.distributed); run one command per process",
                     lower_bound=1)
flags.DEFINE_integer("process_id", 0, "score: this process's id in [0, --num_processes)",
                     lower_bound=0)
flags.DEFINE_string("coordinator", None, "score: HOST:PORT of the jax.distributed coordinator, "
                    "served by process 0 (needed with --num_processes > 1)")

# Every flag that changes a job's results: recorded in its job file, checked on resume.
RESULT_FLAGS = score_records.RESULT_SETTINGS


def _open_scorer():
    from ninfer_jax.scoring import Scorer

    start = time.perf_counter()
    config = {"window": FLAGS.window, "stride": FLAGS.stride, "max_len": FLAGS.max_len,
              "max_batch_tokens": FLAGS.max_batch_tokens, "pack": FLAGS.pack,
              # without a context field there is nothing to share: no shared shapes to compile
              "share_contexts": FLAGS.share_contexts and FLAGS.context_field is not None,
              "dtype": resolve_dtype(FLAGS.dtype)}
    scorer = Scorer.open(FLAGS.model, verify_weights=FLAGS.verify_weights,
                         quantize=FLAGS.quantize, **config)
    print(f"[ninfer] scoring {scorer.model_path}: windows {scorer.core.keys()} compiled in "
          f"{time.perf_counter() - start:.1f}s", file=sys.stderr)
    return scorer


def _prepare(scorer, line: bytes) -> Any:
    """The record's ScoreRequest under the parsed flags, or the reason it cannot be scored."""
    return score_records.prepare(scorer, line, FLAGS.text_field, FLAGS.context_field)


def _check_processes() -> None:
    """Usage errors of the process flags, before anything waits on another process."""
    n, pid, coordinator = FLAGS.num_processes, FLAGS.process_id, FLAGS.coordinator
    if pid >= n:
        raise app.UsageError(f"--process_id={pid} must be in [0, {n}) (--num_processes={n})")
    if n == 1:
        if coordinator:
            raise app.UsageError("--coordinator needs --num_processes > 1")
        return
    if not coordinator:
        raise app.UsageError(f"--num_processes={n} needs --coordinator=HOST:PORT (the address "
                             "process 0 serves the job's coordination on)")
    host, _, port = coordinator.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise app.UsageError(f"--coordinator={coordinator!r} must be HOST:PORT with a port in "
                             "[1, 65535]")
    if FLAGS.perplexity:
        raise app.UsageError("--perplexity runs in one process (drop --num_processes)")


def run_score() -> int:
    _check_processes()
    if FLAGS.perplexity:
        return _run_perplexity()
    if not FLAGS.input or not FLAGS.output:
        raise app.UsageError("score needs --input=FILE.jsonl and --output=FILE.jsonl "
                             "(or --perplexity=FILE.txt)")
    job = score_job.ScoreJob(
        FLAGS.input, FLAGS.output, model=FLAGS.model, text_field=FLAGS.text_field,
        context_field=FLAGS.context_field, window=FLAGS.window, stride=FLAGS.stride,
        max_len=FLAGS.max_len, max_batch_tokens=FLAGS.max_batch_tokens, pack=FLAGS.pack,
        share_contexts=FLAGS.share_contexts, dtype=FLAGS.dtype,
        chunk_records=FLAGS.chunk_records, verify_weights=FLAGS.verify_weights)
    if FLAGS.num_processes == 1:
        score_job.run_job(job, _open_scorer)
        return 0
    from ninfer_jax.gateway import score_parts

    score_parts.join(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
    try:
        score_job.run_job(job, _open_scorer)
    finally:
        score_parts.leave()
    return 0


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
