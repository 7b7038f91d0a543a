"""A batch scoring job's definition and its records (`ninfer score`), shared by the one-process
run (`score_job.py`) and the run split across processes (`score_parts.py`).

Owns what a job is (`ScoreJob`: input, output, model and every setting that changes its
results; `JobReport`), its fixed chunks of records, turning one input line into a scoring
request or the reason it cannot be one, scoring a chunk, and appending its results in input
order as complete lines, flushed and fsynced after every chunk (`write_chunks`). Where the
job file and the parts live beside the output (`job_file`, `parts_dir`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

from ninfer_jax.errors import ConfigError
from ninfer_jax.gateway.files import (
    CommandError,
    RecordError,
    check_unicode,
    iter_lines,
    os_reason,
    parse_record,
)
from ninfer_jax.scoring.core import Occupancy

# Every setting that changes a job's results: recorded in its job file, checked on resume.
RESULT_SETTINGS = ("text_field", "context_field", "window", "stride", "max_len",
                   "max_batch_tokens", "pack", "share_contexts", "dtype", "chunk_records")
_SCORING = ("window", "stride", "max_len", "max_batch_tokens", "pack", "share_contexts", "dtype")
_INT64 = 1 << 63
# Records per chunk: a chunk is scored in one go (its short texts packed, its shared contexts
# read once) and is what a resumed job recomputes.
CHUNK_RECORDS = 256


@dataclasses.dataclass(frozen=True)
class ScoreJob:
    """One scoring job; the fields are `ninfer score`'s flags of the same names."""

    input: str
    output: str
    model: str | os.PathLike | None = None  # None: the embedded demo model
    text_field: str = "text"
    context_field: str | None = None
    window: int | None = None
    stride: int | None = None
    max_len: int | None = None
    max_batch_tokens: int = 4096
    pack: bool = True
    share_contexts: bool = True
    dtype: str = "auto"  # resolved for the running backend when the job starts
    chunk_records: int = CHUNK_RECORDS
    verify_weights: bool = True

    def __post_init__(self):
        if isinstance(self.chunk_records, bool) or not isinstance(self.chunk_records, int) \
                or self.chunk_records < 1:
            raise ConfigError(f"chunk_records must be an integer >= 1, got "
                              f"{self.chunk_records!r:.40}")

    def settings(self) -> dict[str, Any]:
        """What the job file records (dtype as it runs, not "auto")."""
        from ninfer_jax.program.config import resolve_dtype

        out = {name: getattr(self, name) for name in RESULT_SETTINGS}
        out["dtype"] = resolve_dtype(self.dtype)
        return out

    def scoring_config(self) -> dict[str, Any]:
        """The `Scorer.open` settings of this job (no shared-context shapes to compile when
        the records have no context field)."""
        settings = self.settings()
        config = {name: settings[name] for name in _SCORING}
        config["share_contexts"] = self.share_contexts and self.context_field is not None
        return config

    @property
    def model_dir(self) -> pathlib.Path:
        from ninfer_jax.artifact.hf import checkpoint_dir
        from ninfer_jax.loader import DEFAULT_MODEL

        return checkpoint_dir(DEFAULT_MODEL if self.model is None else self.model)


@dataclasses.dataclass(frozen=True)
class JobReport:
    """What one process did for a job in this run."""

    output: str
    num_records: int  # in the whole input
    num_scored: int  # records this process wrote in this run (0: nothing was left)
    num_errors: int  # error lines among them
    num_tokens: int  # tokens scored by this process in this run
    seconds: float
    process_id: int = 0
    num_processes: int = 1
    # how full this process's scoring calls were
    occupancy: Occupancy = dataclasses.field(default_factory=Occupancy)


def job_file(output: str | os.PathLike) -> pathlib.Path:
    from ninfer_jax.gateway.resume import JOB_SUFFIX

    path = pathlib.Path(output)
    return path.with_name(path.name + JOB_SUFFIX)


def parts_dir(output: str | os.PathLike) -> pathlib.Path:
    """Where the processes of a multi-process job keep their parts, beside the output."""
    path = pathlib.Path(output)
    return path.with_name(path.name + ".parts")


def chunk_ranges(total: int, chunk_records: int) -> list[range]:
    """The job's chunks: record ranges of `chunk_records` records from the start."""
    return [range(s, min(s + chunk_records, total)) for s in range(0, total, chunk_records)]


def write_chunks(job: ScoreJob, scorer, path: str | os.PathLike, flag: str,
                 chunks: Sequence[range], done: int, *, progress: bool = True
                 ) -> tuple[int, int, int, Occupancy]:
    """Appends the results of `chunks` (in order) to `path`, which already holds the first
    `done` of their records as complete lines; returns (records written, error lines, tokens,
    how full the scoring calls were).
    The chunk holding the first missing record is scored whole and only its missing records
    written, so the file is what an uninterrupted run writes. `flag` names `path` in errors."""
    from tqdm import tqdm

    wanted = sum(len(c) for c in chunks)
    skip = skipped = 0  # the leading chunks the file holds whole
    while skip < len(chunks) and skipped + len(chunks[skip]) <= done:
        skipped += len(chunks[skip])
        skip += 1
    todo = chunks[skip:]
    first_new = todo[0].start + (done - skipped) if todo else 0
    written = errors = tokens = 0
    start, before = time.perf_counter(), scorer.core.occupancy
    bar = tqdm(total=wanted, initial=done, unit="rec", file=sys.stderr, dynamic_ncols=True,
               disable=not progress)
    with bar, open_append(path, flag) as out:  # the bar ends its line before any error line
        for chunk, lines in _chunk_lines(job.input, todo):
            answers, n = score_chunk(scorer, job, lines)
            new = [a for a in answers if a["index"] >= first_new]
            append(out, "".join(json.dumps(a) + "\n" for a in new).encode(), path, flag)
            written += len(new)
            errors += sum("error" in a for a in new)
            tokens += n
            bar.update(len(new))
            bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.0f}",
                            fill=f"{(scorer.core.occupancy - before).fill:.0%}", errors=errors)
    return written, errors, tokens, scorer.core.occupancy - before


def _chunk_lines(input_path: str, chunks: Sequence[range]
                 ) -> Iterable[tuple[range, list[tuple[int, bytes]]]]:
    """(chunk, its (index, line) pairs) for each of `chunks` (ascending), reading the input
    once."""
    if not chunks:
        return
    k, lines = 0, []
    for index, line in iter_lines("input", input_path):
        if index < chunks[k].start:
            continue
        lines.append((index, line))
        if index == chunks[k].stop - 1:
            yield chunks[k], lines
            k, lines = k + 1, []
            if k == len(chunks):
                return
    raise CommandError(f"--input {input_path!r} changed while the job read it (it ended "
                       f"before record {chunks[k].stop - 1})")


def open_append(path: str | os.PathLike, flag: str):
    """The file, unbuffered: bytes reach it in `append` or not at all, never later (a buffer
    flushed at close would fail a second time on a full disk)."""
    try:
        return open(path, "ab", buffering=0)
    except OSError as e:
        raise CommandError(f"--{flag} {str(path)!r}: cannot write: {os_reason(e)}") from None


def append(out, data: bytes, path: str | os.PathLike, flag: str) -> None:
    """Appends whole lines and makes them durable; a full disk is a CommandError (a later run
    cuts the torn line it may leave and resumes)."""
    try:
        view = memoryview(data)
        while view:
            view = view[out.write(view):]
        os.fsync(out.fileno())
    except OSError as e:
        raise CommandError(f"--{flag} {str(path)!r}: cannot write: {os_reason(e)}") from None


def score_chunk(scorer, job: ScoreJob, chunk: list[tuple[int, bytes]]
                ) -> tuple[list[dict[str, Any]], int]:
    """Result records of one chunk, in order, and the number of tokens scored."""
    answers: dict[int, dict[str, Any]] = {}
    requests, indices = [], []
    for index, line in chunk:
        prepared = prepare(scorer, line, job.text_field, job.context_field)
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


def prepare(scorer, line: bytes, text_field: str, context_field: str | None) -> Any:
    """The record's ScoreRequest, or the reason it cannot be scored. Preparing a record touches
    no shared state, so any failure in it is that record's alone and never stops the job."""
    from ninfer_jax.scoring import ScoreInputError

    try:
        return _item(scorer, line, text_field, context_field)
    except (RecordError, ScoreInputError) as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - e.g. a tokenizer refusing this record's text
        return f"{type(e).__name__}: {e}"


def _item(scorer, line: bytes, text_field: str, context_field: str | None):
    """A checked ScoreRequest for one input line; raises RecordError or ScoreInputError."""
    from ninfer_jax.scoring import ScoreInputError

    record = parse_record(line)
    if text_field not in record:
        raise ScoreInputError(f"missing field {text_field!r}")
    value = _field(record, text_field)
    context = None  # absent or null: none
    if context_field and record.get(context_field) is not None:
        context = _field(record, context_field)
    if isinstance(value, str):
        if not value:
            raise ScoreInputError(f"empty {text_field!r}")
        return scorer.request(text=value, context=context)
    return scorer.request(token_ids=value, context=context)


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
