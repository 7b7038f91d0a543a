"""A batch causal-scoring job (JSONL records in, JSONL results out), resumable: `ninfer score`.

Owns running a job: in this process, or this process's share of a run split across the
processes of a `jax.distributed` job (`gateway/score_parts.py`), and refusing a resume with
another process count. What a job is and how its records are scored and written is
`gateway/score_records.py`; flags belong to `gateway/score.py`.

    from ninfer_jax.gateway.score_job import ScoreJob, run_job, score_jsonl
    report = run_job(ScoreJob("in.jsonl", "out.jsonl", max_len=512))   # opens the model
    report = score_jsonl(scorer, "in.jsonl", "out.jsonl")              # an open Scorer

In a `jax.distributed` job (`jax.distributed.initialize(...)` called before anything else in
jax), `run_job` scores this process's share and process 0 merges the parts
(`score_parts.py`); every process must run it with the same job.

Chunks are fixed runs of `chunk_records` records counted from the start of the input. A file of
results resumes at its first missing record and recomputes the whole chunk it resumes in, so its
numbers are bit-identical to an uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from ninfer_jax.errors import ConfigError
from ninfer_jax.gateway.files import CommandError
from ninfer_jax.gateway.score_parts import run_parts
from ninfer_jax.gateway.score_records import (
    CHUNK_RECORDS,
    JobReport,
    ScoreJob,
    chunk_ranges,
    job_file,
    parts_dir,
    write_chunks,
)

__all__ = ["JobReport", "ScoreJob", "check_process_count", "run_job", "score_jsonl"]

ScorerSource = Any  # a Scorer, or a zero-argument callable that opens one


def run_job(job: ScoreJob, scorer: ScorerSource = None, *, progress: bool = True) -> JobReport:
    """Runs (or resumes) `job` in this process; returns when its output is complete. `scorer`:
    an open Scorer for the job's model and settings, or a callable opening one (None: opened
    with `Scorer.open` when records are left). In a `jax.distributed` job with several
    processes this process scores its share (see `score_parts.py`). progress: a bar on stderr.
    CommandError (input, output, job file) or ConfigError (settings) when it cannot."""
    import jax

    from ninfer_jax.gateway.resume import job_identity

    open_scorer = _scorer_source(job, scorer)
    num_processes = jax.process_count()
    check_process_count(job.output, num_processes)
    identity = job_identity(job.input, job.model_dir, job.settings())
    if num_processes > 1:
        return run_parts(job, identity, open_scorer, progress=progress)
    return _run_one(job, identity, open_scorer, progress)


def score_jsonl(scorer, input: str, output: str, *, text_field: str = "text",
                context_field: str | None = None, chunk_records: int = CHUNK_RECORDS,
                progress: bool = True) -> JobReport:
    """`run_job` with an open Scorer: the job's model and settings are the scorer's."""
    scfg = scorer.core.scfg
    if (scfg.min_len, scfg.top_logprobs) != (64, 0):
        raise ConfigError("a scoring job records window, stride, max_len, max_batch_tokens, "
                          "pack, share_contexts and dtype only; open the Scorer with the "
                          "default min_len and top_logprobs")
    job = ScoreJob(input, output, model=scorer.model_path, text_field=text_field,
                   context_field=context_field, window=scfg.window, stride=scfg.stride,
                   max_len=scfg.max_len, max_batch_tokens=scfg.max_batch_tokens,
                   pack=scfg.pack, share_contexts=scfg.share_contexts, dtype=scfg.dtype,
                   chunk_records=chunk_records)
    return run_job(job, scorer, progress=progress)


def _scorer_source(job: ScoreJob, scorer: ScorerSource) -> Callable[[], Any]:
    if callable(scorer):
        return scorer
    if scorer is not None:
        return lambda: scorer

    def open_scorer():
        from ninfer_jax.scoring import Scorer

        return Scorer.open(job.model, verify_weights=job.verify_weights,
                           **job.scoring_config())

    return open_scorer


def check_process_count(output: str, num_processes: int) -> None:
    """Refuses to resume an output (or its parts) made by another number of processes: the
    parts' layout depends on it. The job file records `num_processes` when it is above 1."""
    job, parts = job_file(output), parts_dir(output)
    started = (os.path.isfile(output) and os.path.getsize(output) > 0) or \
        (parts.is_dir() and any(parts.iterdir()))
    if not started or not job.is_file():
        return
    try:
        recorded = json.loads(job.read_bytes())["settings"].get("num_processes", 1)
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return  # not a job file: prepare_output refuses it, naming it
    if recorded != num_processes:
        raise CommandError(
            f"--num_processes differs: {output!r} belongs to a job run by {recorded} "
            f"process(es), this one has {num_processes}; restart every process with "
            f"--num_processes={recorded} (or choose another --output, or delete it, "
            f"{job.name!r} and {parts.name!r} to start over)")


def _run_one(job: ScoreJob, identity, open_scorer, progress: bool) -> JobReport:
    from ninfer_jax.gateway.resume import prepare_output

    total = identity.num_records
    done = prepare_output(job.output, identity)
    start = time.perf_counter()
    if done == total:
        print(f"[ninfer] {job.output} is complete ({total} records)", file=sys.stderr)
        return JobReport(job.output, total, 0, 0, 0, 0.0)
    scorer = open_scorer()
    chunks = chunk_ranges(total, job.chunk_records)
    n, errors, tokens, occupancy = write_chunks(job, scorer, job.output, "output", chunks,
                                                done, progress=progress)
    seconds = time.perf_counter() - start
    print(f"[ninfer] {n} records ({errors} errors), {tokens} tokens in {seconds:.1f}s, "
          f"{occupancy.summary()} -> {job.output}", file=sys.stderr)
    return JobReport(job.output, total, n, errors, tokens, seconds, occupancy=occupancy)
