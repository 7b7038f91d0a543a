"""Moving bytes off the caller's thread: a per-store thread pool plus gather/scatter copies.

`TransferPool.start(table, job_id, prerequisite, work, release)` runs `work() -> bool` on a pool
thread once the optional prerequisite fired, then `release(success)` (the owner's cleanup: unpin,
commit), then records the success bit in the JobTable; no exception escapes (a failed transfer is
a completion with success=False, G6). numpy copies release the GIL, so transfers overlap with the
caller's compute.

Closing: `close()` cancels every job that has not begun moving bytes (still queued, or waiting on
its prerequisite, which is polled so close never hangs on one that never fires): each completes
with success=False after its `release`. Transfers already moving bytes run to the end and keep
their outcome; `close()` returns once they have. A `start` after close cancels the job at once.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np

from ninfer_jax.store.jobs import JobTable
from ninfer_jax.store.types import Prerequisite

_log = logging.getLogger(__name__)
PREREQUISITE_POLL_S = 0.02  # how soon a job parked on its prerequisite notices close()


class TransferPool:
    """A small thread pool owned by one store."""

    def __init__(self, name: str, num_threads: int):
        self._name = name
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(num_threads, thread_name_prefix=name)

    def start(
        self, table: JobTable, job_id: int, prerequisite: Prerequisite | None,
        work: Callable[[], bool], release: Callable[[bool], None] | None = None,
    ) -> None:
        def run() -> None:
            success = False
            try:
                if self._ready(prerequisite):
                    success = bool(work())
                else:
                    _log.info("%s: job %d cancelled by close() before it moved bytes",
                              self._name, job_id)
            except Exception:  # noqa: BLE001 (a failure is a completion, never an escape: G6)
                _log.exception("%s: job %d failed", self._name, job_id)
            if release is not None:
                try:
                    release(success)
                except Exception:  # noqa: BLE001 (the completion must still be recorded)
                    _log.exception("%s: releasing job %d failed", self._name, job_id)
            table.finish(job_id, success)

        with self._lock:
            if not self._closing.is_set():
                self._pool.submit(run)
                return
        run()  # closed: `_ready` refuses, so this only cancels the job

    def _ready(self, prerequisite: Prerequisite | None) -> bool:
        """True once the prerequisite fired; False if the pool closes first."""
        while not self._closing.is_set():
            if prerequisite is None or prerequisite.wait(PREREQUISITE_POLL_S):
                return True
        return False

    def close(self) -> None:
        """Cancels jobs that have not started and waits for running ones; idempotent."""
        with self._lock:
            self._closing.set()
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
