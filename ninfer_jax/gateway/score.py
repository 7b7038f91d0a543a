"""`ninfer score`: batch causal-scoring jobs (JSONL in, JSONL out) and corpus perplexity.

    ninfer score --input=IN.jsonl --output=OUT.jsonl [--text_field=text] [--context_field=F]
                 [--window=N --stride=S] [--model=DIR]
    ninfer score --perplexity=FILE.txt [--window=N --stride=S] [--model=DIR]

Owns reading records, writing results, the progress bar (stderr) and resumption. Output line i
answers input line i: `{"index", "num_tokens", "sum_logprob", "is_greedy", "token_logprobs"}`,
or `{"index", "error"}` for a bad record (not JSON, missing or empty field, too long without a
window), and the job goes on. A record's field may hold text or a list of token ids.

Resumable and crash-safe: results are appended in input order as complete lines, flushed and
fsynced after every chunk of records. A restart with the same output cuts a torn last line,
keeps every complete one and resumes at the first missing record. Chunks are fixed runs of
`--chunk_records` records counted from the start of the input, and a resumed run recomputes the
whole chunk it resumes in, so its numbers are bit-identical to an uninterrupted run's.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from collections.abc import Iterator
from typing import Any

from absl import app, flags

FLAGS = flags.FLAGS
flags.DEFINE_string("input", None, "score: JSONL file of records to score")
flags.DEFINE_string("output", None, "score: JSONL file of results (resumed if it exists)")
flags.DEFINE_string("text_field", "text", "score: record field with the text (or token ids)")
flags.DEFINE_string("context_field", None,
                    "score: record field with a context (text or token ids); only the text "
                    "after it is scored; a record without the field has no context")
flags.DEFINE_integer("window", None, "score: rolling window in tokens (default: no rolling)")
flags.DEFINE_integer("stride", None, "score: new tokens scored per later window (default: window)")
flags.DEFINE_integer("max_len", None, "score: longest window without --window (default: the "
                     "model's limit, at most 2048)")
flags.DEFINE_integer("max_batch_tokens", 4096, "score: tokens per device call")
flags.DEFINE_integer("chunk_records", 64, "score: records per fsynced output chunk")
flags.DEFINE_string("perplexity", None, "score: print the corpus perplexity of this text file")


def _open_scorer():
    from ninfer_jax.scoring import Scorer

    start = time.perf_counter()
    config = {"window": FLAGS.window, "stride": FLAGS.stride, "max_len": FLAGS.max_len,
              "max_batch_tokens": FLAGS.max_batch_tokens, "dtype": FLAGS.dtype}
    scorer = Scorer.open(FLAGS.model, **config)
    print(f"[ninfer] scoring {scorer.model_path}: windows {scorer.core.keys()} compiled in "
          f"{time.perf_counter() - start:.1f}s", file=sys.stderr)
    return scorer


def recover_output(path: str) -> int:
    """Cuts a torn last line off `path` (if any) and returns its number of complete records."""
    if not os.path.exists(path):
        return 0
    with open(path, "rb+") as f:
        data = f.read()
        keep = data.rfind(b"\n") + 1
        if keep < len(data):
            f.truncate(keep)
            f.flush()
            os.fsync(f.fileno())
    lines = data[:keep].splitlines()
    for n, line in enumerate(lines):
        if json.loads(line).get("index") != n:
            raise app.UsageError(f"--output {path} line {n + 1} is not record {n}; "
                                 "not an output of this input")
    return len(lines)


def _records(path: str) -> Iterator[tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        yield from enumerate(line.rstrip("\n") for line in f)


def _item(scorer, line: str):
    """A checked ScoreRequest for one input line; raises ValueError with the reason."""
    from ninfer_jax.scoring import ScoreInputError

    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ScoreInputError(f"not JSON: {e}") from None
    if not isinstance(record, dict):
        raise ScoreInputError("a record must be a JSON object")
    if FLAGS.text_field not in record:
        raise ScoreInputError(f"missing field {FLAGS.text_field!r}")
    value = record[FLAGS.text_field]
    context = record.get(FLAGS.context_field) if FLAGS.context_field else None  # absent: none
    if isinstance(value, str):
        if not value:
            raise ScoreInputError(f"empty {FLAGS.text_field!r}")
        return scorer.request(text=value, context=context)
    if isinstance(value, list):
        return scorer.request(token_ids=value, context=context)
    raise ScoreInputError(f"{FLAGS.text_field!r} must be a string or a list of token ids")


def _score_chunk(scorer, chunk: list[tuple[int, str]]) -> tuple[list[dict[str, Any]], int]:
    """Result records of one chunk, in order, and the number of tokens scored."""
    from ninfer_jax.scoring import ScoreInputError

    answers: dict[int, dict[str, Any]] = {}
    requests, indices = [], []
    for index, line in chunk:
        try:
            requests.append(_item(scorer, line))
            indices.append(index)
        except ScoreInputError as e:
            answers[index] = {"index": index, "error": str(e)}
    results = scorer.score_requests(requests)
    for index, r in zip(indices, results):
        answers[index] = {"index": index, "num_tokens": r.num_tokens,
                          "sum_logprob": r.sum_logprob, "is_greedy": r.is_greedy,
                          "token_logprobs": [float(x) for x in r.token_logprobs]}
    return [answers[i] for i, _ in chunk], sum(r.num_tokens for r in results)


def run_score() -> int:
    if FLAGS.perplexity:
        return _run_perplexity()
    if not FLAGS.input or not FLAGS.output:
        raise app.UsageError("score needs --input=FILE.jsonl and --output=FILE.jsonl "
                             "(or --perplexity=FILE.txt)")
    if FLAGS.chunk_records < 1:
        raise app.UsageError("--chunk_records must be >= 1")
    from tqdm import tqdm

    total = sum(1 for _ in _records(FLAGS.input))
    done = recover_output(FLAGS.output)
    if done > total:
        raise app.UsageError(f"--output has {done} records, the input only {total}")
    if done == total:
        print(f"[ninfer] {FLAGS.output} is complete ({total} records)", file=sys.stderr)
        return 0
    scorer = _open_scorer()
    resume = done - done % FLAGS.chunk_records  # recompute the chunk we resume in
    errors = tokens = 0
    start = time.perf_counter()
    bar = tqdm(total=total, initial=done, unit="rec", file=sys.stderr, dynamic_ncols=True)
    with open(FLAGS.output, "a", encoding="utf-8") as out:
        chunk: list[tuple[int, str]] = []
        for index, line in _records(FLAGS.input):
            if index < resume:
                continue
            chunk.append((index, line))
            if len(chunk) == FLAGS.chunk_records or index == total - 1:
                answers, n = _score_chunk(scorer, chunk)
                new = [a for a in answers if a["index"] >= done]
                out.write("".join(json.dumps(a) + "\n" for a in new))
                out.flush()
                os.fsync(out.fileno())
                errors += sum("error" in a for a in new)
                tokens += n
                bar.update(len(new))
                bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}",
                                errors=errors)
                chunk = []
    bar.close()
    print(f"[ninfer] {total - done} records ({errors} errors), {tokens} tokens in "
          f"{time.perf_counter() - start:.1f}s -> {FLAGS.output}", file=sys.stderr)
    return 0


def _run_perplexity() -> int:
    with open(FLAGS.perplexity, encoding="utf-8") as f:
        text = f.read()
    scorer = _open_scorer()
    start = time.perf_counter()
    [result] = scorer.rolling([text])
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
