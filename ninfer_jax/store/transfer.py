"""Moving bytes off the caller's thread: a per-store thread pool plus gather/scatter copies.

`TransferPool.start(table, job_id, prerequisite, work)` runs `work() -> bool` on a pool thread
after the optional prerequisite, records the success bit in the JobTable and never lets an
exception escape (a failed transfer is a completion with success=False, G6). numpy copies release
the GIL, so transfers overlap with the caller's compute.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Sequence

import numpy as np

from ninfer_jax.store.jobs import JobTable
from ninfer_jax.store.types import Prerequisite

_log = logging.getLogger(__name__)


class TransferPool:
    """A small thread pool owned by one store."""

    def __init__(self, name: str, num_threads: int):
        self._name = name
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix=name)

    def start(
        self, table: JobTable, job_id: int, prerequisite: Prerequisite | None,
        work: Callable[[], bool],
    ) -> None:
        def run() -> None:
            success = False
            try:
                if prerequisite is not None:
                    prerequisite.wait()
                success = bool(work())
            except Exception:
                _log.exception("%s: job %d failed", self._name, job_id)
            table.finish(job_id, success)

        self._pool.submit(run)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def as_u8(view: memoryview) -> np.ndarray:
    return np.frombuffer(view, dtype=np.uint8)


def gather(sources: Sequence[memoryview], dest: np.ndarray) -> None:
    """Concatenates `sources` into the flat uint8 array `dest` (sizes already checked)."""
    offset = 0
    for src in sources:
        n = src.nbytes
        dest[offset : offset + n] = as_u8(src)
        offset += n


def scatter(source: np.ndarray, dests: Sequence[memoryview]) -> None:
    """Splits the flat uint8 array `source` over the writable views `dests`."""
    offset = 0
    for dst in dests:
        n = dst.nbytes
        np.frombuffer(dst, dtype=np.uint8)[...] = source[offset : offset + n]
        offset += n
