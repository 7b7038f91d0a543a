"""PosixStore's Prefetchable facet: bringing blocks up from the tier directly below as files.

Present on a posix tier with a tier below and a `block_bytes` (a prefetch has no caller's buffer
to size its reads by). Owns the per-request prefetch signals and the prefetch plans.
- `lookup` answers hits (verified files here), or None when some missing block is present below
  (for a middle tier below: in it or further down, so a block comes up from any depth);
- `prepare_prefetch` remembers the blocks and pins them below when that tier is tokened; it
  reserves nothing here (posix has no capacity and never evicts) and the request's TTL has
  nothing to bind to (posix keeps no retention);
- `prefetch` reads the blocks from below, at most BATCH_BYTES at a time, and writes each one as a
  file with the dump's crash-safe write (temp, fsync, rename, directory fsync), so a prefetched
  file holds exactly the bytes below (verified there) and is verified here like any other;
- `complete_prefetch` concludes the plan and drops its pins below, refusing while a prefetch job
  of the plan has not been consumed (G4).
A file is committed by its rename, as a dump's is: a failed or rolled-back prefetch keeps the
blocks it already wrote (each a whole copy of what is below, G1) and never deletes one, since a
concurrent dump may have committed the same block.
"""

from __future__ import annotations

import dataclasses
import itertools
import struct
import threading
from collections.abc import Callable, Sequence

import numpy as np

from ninfer_jax.store.base import Prefetchable
from ninfer_jax.store.errors import InvalidParam, NotFound
from ninfer_jax.store.jobs import JobTable
from ninfer_jax.store.lifecycle import Lifecycle, while_open
from ninfer_jax.store.lower import LowerTier
from ninfer_jax.store.transfer import TransferPool
from ninfer_jax.store.types import AddressedToken, BlockId, BlockPayload, RequestContext

BATCH_BYTES = 64 << 20  # host memory one prefetch job holds at a time
_PLAN = struct.Struct("<Q")


@dataclasses.dataclass
class _Plan:
    request_id: str
    ids: list[BlockId]
    lower_pinned: bool
    running: set[int] = dataclasses.field(default_factory=set)


class PosixPrefetch(Prefetchable):
    def __init__(self, life: Lifecycle, lower: LowerTier, jobs: JobTable, pool: TransferPool,
                 block_bytes: int, present: Callable[[BlockId], bool],
                 write: Callable[[BlockId, BlockPayload], bool]):
        """`present`: a verified file here; `write`: the crash-safe write of one block."""
        self.life = life
        self._lower = lower
        self._jobs = jobs
        self._pool = pool
        self._block_bytes = block_bytes
        self._present = present
        self._write = write
        self._lock = threading.Lock()
        self._signals: dict[str, list[BlockId]] = {}
        self._plans: dict[int, _Plan] = {}
        self._plan_numbers = itertools.count()

    @while_open
    def lookup(self, request_id: str, ids: Sequence[BlockId],
               prefix: bool = False) -> list[bool] | None:
        """`prefix` changes nothing here: this tier has no capacity to spend."""
        del prefix
        hits = [self._present(block_id) for block_id in ids]
        missing = [b for b, hit in zip(ids, hits) if not hit]
        below = self._lower.lookup(missing)
        prefetchable = [b for b, hit in zip(missing, below) if hit]
        with self._lock:
            if prefetchable:
                self._signals[request_id] = prefetchable
                return None
            self._signals.pop(request_id, None)
            return hits

    @while_open
    def prepare_prefetch(self, request_id: str, ctx: RequestContext) -> AddressedToken:
        with self._lock:
            ids = self._signals.get(request_id)
            if ids is None:
                raise InvalidParam(f"posix: request {request_id!r} has no pending prefetch "
                                   "signal; a lookup must return None first")
            pinned = self._lower.pin(ids)
            del self._signals[request_id]
            number = next(self._plan_numbers)
            self._plans[number] = _Plan(request_id, ids, pinned)
            return AddressedToken(tuple(ids), _PLAN.pack(number))

    @while_open
    def prefetch(self, job_id: int, plan: AddressedToken) -> None:
        with self._lock:
            _, record = self._plan(plan)

            def consumed(success: bool) -> None:
                with self._lock:
                    record.running.discard(job_id)

            self._jobs.accept(job_id, consumed)
            record.running.add(job_id)
        self._pool.start(self._jobs, job_id, None, lambda: self._move(record))

    @while_open
    def forget(self, request_id: str) -> None:
        with self._lock:
            self._signals.pop(request_id, None)

    @while_open
    def complete_prefetch(self, plan: AddressedToken, success: bool) -> None:
        """Concludes the plan; its files stay whatever `success` says (see the module doc)."""
        with self._lock:
            number, record = self._plan(plan)
            if record.running:
                raise InvalidParam(f"posix: complete_prefetch of plan for request "
                                   f"{record.request_id!r} refused: job(s) "
                                   f"{sorted(record.running)} not consumed yet")
            if record.lower_pinned:
                self._lower.unpin(record.ids)
            del self._plans[number]

    def _move(self, record: _Plan) -> bool:
        """Reads the plan's blocks from below and writes each one here."""
        per_batch = max(1, BATCH_BYTES // self._block_bytes)
        for start in range(0, len(record.ids), per_batch):
            ids = record.ids[start : start + per_batch]
            payloads = [BlockPayload([np.empty(self._block_bytes, np.uint8)]) for _ in ids]
            if not self._lower.load(ids, payloads, pinned=record.lower_pinned):
                return False
            for block_id, payload in zip(ids, payloads):
                self._write(block_id, payload)
        return True

    def _plan(self, plan: AddressedToken) -> tuple[int, _Plan]:
        if len(plan.payload) != _PLAN.size:
            raise InvalidParam(f"posix: prefetch plan payload must be {_PLAN.size} bytes, "
                               f"got {len(plan.payload)}")
        (number,) = _PLAN.unpack(plan.payload)
        record = self._plans.get(number)
        if record is None:
            raise NotFound(f"posix: prefetch plan {number} is unknown or already completed")
        return number, record
