"""In-flight job bookkeeping with exactly-once completion (DESIGN §11, G5/G6).

A `JobTable` owns the life of caller-chosen job ids: accepted (unique among unconsumed jobs) ->
finished (success bit recorded) -> consumed exactly once by `get_finished()` or `wait(ids)`.
It knows nothing about what a job moves; an optional `on_consumed` callback lets the owner
release per-job state (busy counts, plans) at the moment the caller has seen the completion.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

from ninfer_jax.store.errors import InvalidParam, NotFound
from ninfer_jax.store.types import IoResult


@dataclasses.dataclass
class _Job:
    on_consumed: Callable[[bool], None] | None
    finished: bool = False
    success: bool = False


class JobTable:
    """Thread-safe table of unconsumed jobs; waits block on a condition variable."""

    def __init__(self, owner: str):
        self._owner = owner
        self._cv = threading.Condition()
        self._jobs: dict[int, _Job] = {}
        self._finished_order: list[int] = []

    def accept(self, job_id: int, on_consumed: Callable[[bool], None] | None = None) -> None:
        """Registers `job_id`; a duplicate of an unconsumed id is InvalidParam (G5)."""
        if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id < 0:
            raise InvalidParam(f"{self._owner}: job id must be a non-negative int, got {job_id!r}")
        with self._cv:
            if job_id in self._jobs:
                raise InvalidParam(f"{self._owner}: job id {job_id} is already in flight")
            self._jobs[job_id] = _Job(on_consumed)

    def discard(self, job_id: int) -> None:
        """Forgets an accepted job whose transfer never started (its submit then raises)."""
        with self._cv:
            self._jobs.pop(job_id, None)

    def finish(self, job_id: int, success: bool) -> None:
        with self._cv:
            job = self._jobs[job_id]
            job.finished, job.success = True, bool(success)
            self._finished_order.append(job_id)
            self._cv.notify_all()

    def is_known(self, job_id: int) -> bool:
        with self._cv:
            return job_id in self._jobs

    def num_unconsumed(self) -> int:
        with self._cv:
            return len(self._jobs)

    def num_running(self) -> int:
        with self._cv:
            return sum(not job.finished for job in self._jobs.values())

    def get_finished(self) -> list[IoResult]:
        """Consumes every finished job, in finishing order."""
        with self._cv:
            ids = [j for j in self._finished_order if j in self._jobs]
            self._finished_order.clear()
            consumed = [(j, self._jobs.pop(j)) for j in ids]
        return self._consume(consumed)

    def wait(self, job_ids: Sequence[int]) -> list[IoResult]:
        """Blocks until every listed job finished, then consumes them; results follow `job_ids`.

        An id that is not an unconsumed job (never accepted, or consumed already) is NotFound and
        nothing is consumed.
        """
        job_ids = list(job_ids)
        if len(set(job_ids)) != len(job_ids):
            raise InvalidParam(f"{self._owner}: wait got a repeated job id in {job_ids}")
        with self._cv:
            for job_id in job_ids:
                if job_id not in self._jobs:
                    raise NotFound(f"{self._owner}: job id {job_id} is not in flight")
            while True:
                missing = [j for j in job_ids if j not in self._jobs]
                if missing:
                    raise NotFound(f"{self._owner}: job id {missing[0]} was consumed by "
                                   "another caller while waiting")
                if all(self._jobs[j].finished for j in job_ids):
                    break
                self._cv.wait()
            consumed = [(j, self._jobs.pop(j)) for j in job_ids]
            self._finished_order = [j for j in self._finished_order if j in self._jobs]
        return self._consume(consumed)

    def wait_all_finished(self) -> None:
        """Blocks until no accepted job is still running (its completion may be unconsumed)."""
        with self._cv:
            while any(not job.finished for job in self._jobs.values()):
                self._cv.wait()

    @staticmethod
    def _consume(consumed: list[tuple[int, _Job]]) -> list[IoResult]:
        for _, job in consumed:
            if job.on_consumed is not None:
                job.on_consumed(job.success)
        return [IoResult(job_id, job.success) for job_id, job in consumed]
