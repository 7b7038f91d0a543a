"""One scoring job split across the N processes of a `jax.distributed` run (`ninfer score
--num_processes=N --process_id=P --coordinator=HOST:PORT`).

Owns joining the processes, which process scores which records, the part files and their merge.
Chunk c of the job (records [c*K, (c+1)*K), K = chunk_records) belongs to process c % N. Process
P appends the results of its chunks, in order, to its part `OUT.parts/part-P-of-N.jsonl` with the
one-process discipline (complete lines, flush + fsync per chunk; a restart cuts a torn line and
recomputes the chunk it resumes in; `score_records.write_chunks`). When every part is complete,
process 0 merges them into OUT in input order, appending and fsyncing chunk by chunk (a merge
cut short resumes where OUT ends), then deletes the parts. A chunk's lines are the same bytes
whichever process scored them, so OUT is byte-identical to a one-process run's.

The job file (`gateway/resume.py`) records `num_processes`; a restart with another count is
refused naming `--num_processes`, since the parts' layout depends on it. Every process checks
its own job identity against the job file, so a process started with other flags or another
input is refused too.

Coordination uses the jax.distributed client only (key-value store and barriers; jax has no
public handle on it, hence `jax._src.distributed`): the run goes through phases (job, plan,
score, merge); in each, every process does its part, publishes "ok" or its error under the
phase's key, and waits at the phase's barrier, so an error in any process ends every process
with an error line instead of leaving the others waiting. Scoring needs no cross-process
collective: each process scores on its own first local device. All processes open the model
when any has records left (orbax's restore synchronises the processes of a jax.distributed
run). A process that dies (SIGKILL) makes jax end the others within `HEARTBEAT_TIMEOUT_S`
(the coordination service aborts every task); restart all of them with the same command.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

from ninfer_jax.errors import NinferError
from ninfer_jax.gateway.files import CommandError, os_reason
from ninfer_jax.gateway.score_records import (
    JobReport,
    ScoreJob,
    append,
    chunk_ranges,
    job_file,
    open_append,
    parts_dir,
    write_chunks,
)
from ninfer_jax.scoring.core import Occupancy

INIT_TIMEOUT_S = 300  # every process must have joined within this
HEARTBEAT_TIMEOUT_S = 60  # a process silent this long is dead: jax ends the others
_WAIT_MS = 7 * 24 * 3600 * 1000  # a phase may last as long as scoring does
_KEY = "ninfer_score"


def join(coordinator: str, num_processes: int, process_id: int) -> None:
    """`jax.distributed.initialize` for a scoring job; must run before anything else uses jax.
    A coordinator that cannot be reached, or peers that do not join within INIT_TIMEOUT_S, are
    a CommandError naming --coordinator."""
    import jax

    try:
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                                   process_id=process_id, initialization_timeout=INIT_TIMEOUT_S,
                                   heartbeat_timeout_seconds=HEARTBEAT_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - jax raises JaxRuntimeError, RuntimeError, ValueError
        raise CommandError(f"--coordinator {coordinator!r}: process {process_id} of "
                           f"{num_processes} could not join the job: {e}") from None


def leave() -> None:
    import jax

    jax.distributed.shutdown()


def part_path(output: str, process_id: int, num_processes: int) -> pathlib.Path:
    return parts_dir(output) / f"part-{process_id}-of-{num_processes}.jsonl"


def my_chunks(total: int, chunk_records: int, process_id: int, num_processes: int
              ) -> list[range]:
    return chunk_ranges(total, chunk_records)[process_id::num_processes]


def run_parts(job: ScoreJob, identity, open_scorer: Callable[[], Any], *,
              progress: bool = True) -> JobReport:
    """This process's share of `job` (see the module docstring); process 0 also merges."""
    import dataclasses

    import jax

    pid, n = jax.process_index(), jax.process_count()
    identity = dataclasses.replace(identity, settings={**identity.settings, "num_processes": n})
    total = identity.num_records
    phases = _Phases(pid, n)
    done = phases.run("job", lambda: _prepare_job(job, identity) if pid == 0 else None)[0]
    if done == total:
        print(f"[ninfer] {job.output} is complete ({total} records)", file=sys.stderr)
        return JobReport(job.output, total, 0, 0, 0, 0.0, pid, n)
    chunks = my_chunks(total, job.chunk_records, pid, n)
    part = part_path(job.output, pid, n)

    def plan() -> int:
        if pid:  # process 0's identity is the job file's (prepare_output)
            _check_identity(job, identity, job_file(job.output), "another process made it")
        return _part_done(part, chunks)

    held = phases.run("plan", plan)
    wanted = [sum(len(c) for c in my_chunks(total, job.chunk_records, p, n)) for p in range(n)]
    start = time.perf_counter()
    written = errors = tokens = 0
    occupancy = Occupancy()

    def score() -> None:
        nonlocal written, errors, tokens, occupancy
        scorer = open_scorer()  # in every process: the model's restore synchronises them
        if held[pid] < wanted[pid]:
            written, errors, tokens, occupancy = write_chunks(
                job, scorer, part, "output", chunks, held[pid], progress=progress)

    if any(h < w for h, w in zip(held, wanted)):
        phases.run("score", score)
    seconds = time.perf_counter() - start
    print(f"[ninfer] process {pid} of {n}: {written} records ({errors} errors), {tokens} "
          f"tokens in {seconds:.1f}s, {occupancy.summary()} -> {part}", file=sys.stderr)
    phases.run("merge", lambda: _merge(job, total, n, done) if pid == 0 else None)
    if pid == 0:
        print(f"[ninfer] merged {n} parts -> {job.output}", file=sys.stderr)
    return JobReport(job.output, total, written, errors, tokens, seconds, pid, n, occupancy)


class _Phases:
    """Runs one phase in every process: each publishes its value (or error) and waits for the
    others; an error anywhere is raised everywhere (the process's own exception as it is, a
    peer's as a CommandError naming the process)."""

    def __init__(self, process_id: int, num_processes: int):
        from jax._src import distributed

        self.client = distributed.global_state.client
        if self.client is None:
            raise RuntimeError("jax.distributed is not initialized")
        self.pid, self.n = process_id, num_processes

    def run(self, name: str, fn: Callable[[], Any]) -> list[Any]:
        """Every process's value of `fn` for phase `name`, by process id."""
        own: BaseException | None = None
        try:
            value = {"ok": fn()}
        except BaseException as e:  # noqa: BLE001 - published, then raised again below
            own, value = e, {"error": str(e) if isinstance(e, NinferError)
                             else f"{type(e).__name__}: {e}"}
        self.client.key_value_set(f"{_KEY}/{name}/{self.pid}", json.dumps(value))
        self.client.wait_at_barrier(f"{_KEY}/{name}", _WAIT_MS)
        if own is not None:
            raise own
        values = self._read(name)
        for p, v in enumerate(values):
            if "error" in v:
                raise CommandError(f"process {p} of {self.n} failed: {v['error']}")
        return [v["ok"] for v in values]

    def values(self, name: str) -> list[Any]:
        return [v["ok"] for v in self._read(name)]

    def _read(self, name: str) -> list[dict[str, Any]]:
        return [json.loads(self.client.blocking_key_value_get(f"{_KEY}/{name}/{p}", _WAIT_MS))
                for p in range(self.n)]


def _prepare_job(job: ScoreJob, identity) -> int:
    """Process 0's part of the job phase: checks that existing parts belong to this job, makes
    the output ready (`prepare_output`: job file, torn line cut) and the parts directory; returns
    the records OUT holds."""
    from ninfer_jax.gateway.resume import prepare_output

    parts = parts_dir(job.output)
    if _empty(job.output) and parts.is_dir() and any(parts.iterdir()):
        # prepare_output checks the job file of an output with lines only
        _check_identity(job, identity, job_file(job.output), f"{parts.name!r} holds parts")
    done = prepare_output(job.output, identity)
    if done == identity.num_records:
        shutil.rmtree(parts, ignore_errors=True)  # a merge that ended before its clean-up
    else:
        _mkdir(parts, job.output)
    return done


def _check_identity(job: ScoreJob, identity, job_path: pathlib.Path, what: str) -> None:
    from ninfer_jax.gateway.resume import JobIdentity

    if not job_path.is_file():
        raise CommandError(f"--output {job.output!r}: {what} but there is no job file "
                           f"{job_path.name!r}; refusing to resume (delete them or choose "
                           "another --output)")
    try:
        theirs = JobIdentity.from_json(json.loads(job_path.read_bytes()))
    except (OSError, ValueError, TypeError, RecursionError) as e:
        raise CommandError(f"--output {job.output!r}: its job file {job_path.name!r} is not "
                           f"valid ({e}); refusing to resume") from None
    diff = identity.differences(theirs)
    if diff:
        raise CommandError(f"--output {job.output!r} belongs to another job: " + "; ".join(diff)
                           + "; refusing to resume (choose another --output, or delete it, "
                           "its job file and its parts to start over)")


def _empty(path: str) -> bool:
    return not os.path.isfile(path) or os.path.getsize(path) == 0


def _mkdir(path: pathlib.Path, output: str) -> None:
    try:
        path.mkdir(exist_ok=True)
    except OSError as e:
        raise CommandError(f"--output {output!r}: cannot make {str(path)!r}: "
                           f"{os_reason(e)}") from None


def _part_done(part: pathlib.Path, chunks: list[range]) -> int:
    """How many records of `chunks` (in order) the part holds as complete lines; a torn last
    line is cut. CommandError when a line is not the result of the record it should be."""
    expected = (i for c in chunks for i in c)
    count = end = 0
    try:
        if not part.exists():
            return 0
        with open(part, "rb") as f:
            for line in f:
                if not line.endswith(b"\n"):
                    break
                want = next(expected, None)
                try:
                    index = json.loads(line).get("index")
                except (ValueError, AttributeError, RecursionError):
                    index = None
                if want is None or index != want:
                    raise CommandError(f"part {str(part)!r} line {count + 1} is not the result "
                                       f"of record {want}; not a part of this job (delete "
                                       f"{part.parent.name!r} to rescore the parts)")
                count, end = count + 1, end + len(line)
        if end < part.stat().st_size:
            with open(part, "rb+") as f:
                f.truncate(end)
                f.flush()
                os.fsync(f.fileno())
    except OSError as e:
        raise CommandError(f"part {str(part)!r}: {os_reason(e)}") from None
    return count


def _merge(job: ScoreJob, total: int, n: int, done: int) -> None:
    """Appends every part's lines to OUT in input order, from record `done` on (what OUT holds
    already), one chunk at a time with fsync; then deletes the parts."""
    chunks = chunk_ranges(total, job.chunk_records)
    paths = [part_path(job.output, p, n) for p in range(min(n, len(chunks)))]
    with contextlib.ExitStack() as stack:
        try:
            readers = [stack.enter_context(open(path, "rb")) for path in paths]
        except OSError as e:
            raise CommandError(f"--output {job.output!r}: cannot read a part: "
                               f"{os_reason(e)}") from None
        out = stack.enter_context(open_append(job.output, "output"))
        for c, chunk in enumerate(chunks):
            lines = [readers[c % n].readline() for _ in chunk]
            if not all(line.endswith(b"\n") for line in lines):
                raise CommandError(f"part {str(paths[c % n])!r} ends before record "
                                   f"{chunk.stop - 1}; delete it to rescore its records")
            if chunk.stop > done:
                append(out, b"".join(lines[max(0, done - chunk.start):]), job.output, "output")
    shutil.rmtree(parts_dir(job.output), ignore_errors=True)
