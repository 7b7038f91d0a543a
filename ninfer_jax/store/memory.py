"""The `cache` store: host memory, a fixed slab of slots managed by a CacheBuffer.

Config: `capacity` (blocks), `policy` (`lru`|`clock`|`fifo`, default `lru`), `block_bytes` (every
block is exactly this many bytes, split over any number of buffers), `num_threads` (transfer
threads, default 2), and `piped_lower_store` (injected by a pipe: the tier below).

Owns the slab, the CacheBuffer and the job table. With a lower tier it writes through (a dump
completes only once the tier below holds the block too, so an evicted block stays readable from
there) and is Prefetchable (see memory_prefetch). A batch larger than what the slab can place
still lands: blocks already here keep their slots, the leading newcomers (batch order) that find
a slot are written here and through, the rest straight to the tier below (`overflow_allocs`
counts their outstanding allocs; every alloc of such a block goes below until they are concluded,
so sharers agree on where it lives, G7). Without a tier below such a batch is NoSpace naming the
batch size and the capacity, and reserves nothing. Safety rules (G4): a final
`commit` is refused while a dump of the block is unconsumed, and an `unpin` that would leave a
block unpinned is refused while a load of it is unconsumed; `commit(True)` publishes only blocks
a successful dump wrote (G2). Life (lifecycle.py): after `close()` the store and its facets refuse
every call but `wait`/`get_finished`; jobs in flight at close complete (cancelled ones failed).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ninfer_jax.store.base import Prefetchable, Store, TokenAddressed
from ninfer_jax.store.cache_buffer import CacheBuffer
from ninfer_jax.store.config import get_int, get_str, reject_unknown, require_mapping
from ninfer_jax.store.errors import InvalidParam
from ninfer_jax.store.jobs import JobTable
from ninfer_jax.store.lifecycle import Lifecycle, while_open
from ninfer_jax.store.memory_prefetch import CachePrefetch
from ninfer_jax.store.policies import known_policies
from ninfer_jax.store.transfer import TransferPool, gather, scatter
from ninfer_jax.store.types import (
    AddressedToken,
    BlockId,
    BlockPayload,
    IoResult,
    JobDescriptor,
    RequestContext,
    ids_hex,
    require_unique,
)

_FIELDS = ("capacity", "policy", "block_bytes", "num_threads", "piped_lower_store")


class CacheStore(Store):
    name = "cache"

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self.lock = threading.RLock()
        self.lower: Store | None = None
        self.life = Lifecycle("cache")

    def setup(self, config: Mapping[str, Any]) -> None:
        self.life.require_new("setup")
        config = require_mapping(config, "cache")
        reject_unknown(config, _FIELDS, "cache")
        capacity = get_int(config, "capacity", "cache", minimum=1)
        policy = get_str(config, "policy", "cache", default="lru", choices=known_policies())
        self.block_bytes = get_int(config, "block_bytes", "cache", minimum=1)
        num_threads = get_int(config, "num_threads", "cache", default=2, minimum=1)
        lower = config.get("piped_lower_store")
        if lower is not None and not isinstance(lower, Store):
            raise InvalidParam(f"cache: config field 'piped_lower_store' must be a Store, "
                               f"got {type(lower).__name__}")
        self.lower = lower
        size = capacity * self.block_bytes
        memory = _physical_memory()
        if memory and size > memory:  # np.empty / the policy's per-slot lists: a MemoryError
            raise InvalidParam(f"cache: capacity {capacity} x block_bytes {self.block_bytes} = "
                               f"{size} bytes exceeds this machine's memory ({memory} bytes)")
        try:
            self.buffer = CacheBuffer(capacity, policy, self._clock)
            self.slab = np.empty((capacity, self.block_bytes), dtype=np.uint8)
        except (MemoryError, ValueError) as e:
            raise InvalidParam(f"cache: cannot allocate capacity {capacity} x block_bytes "
                               f"{self.block_bytes} ({type(e).__name__}: {e})") from None
        self.jobs = JobTable("cache")
        self.pool = TransferPool("cache", num_threads)
        self._busy: dict[tuple[bool, BlockId], int] = {}
        self._written: set[BlockId] = set()
        self.overflow_allocs: dict[BlockId, int] = {}
        self._lower_job_ids = itertools.count()
        self._token_facet = _CacheTokenFacet(self)
        self._prefetch_facet = CachePrefetch(self) if lower is not None else None
        self.life.open()

    @while_open
    def as_token_addressed(self) -> TokenAddressed:
        return self._token_facet

    @while_open
    def as_prefetchable(self) -> Prefetchable | None:
        return self._prefetch_facet

    # -- base Store: self-guarded transfers ------------------------------------------------------
    @while_open
    def lookup(self, ids: Sequence[BlockId]) -> list[bool]:
        with self.lock:
            return self.buffer.lookup(ids)

    @while_open
    def touch(self, ids: Sequence[BlockId], ttl_ms: int | None) -> None:
        with self.lock:
            self.buffer.touch(ids, ttl_ms)

    @while_open
    def load(self, job_id: int, job: JobDescriptor) -> None:
        """Pins the blocks for the transfer's duration; a missing block is NotFound."""
        with self.lock:
            slots = self.buffer.pin(job.block_ids)
            try:
                self.check_sizes(job)
                self.jobs.accept(job_id)
            except Exception:
                self.buffer.unpin(job.block_ids)
                raise

        def work() -> bool:
            self.copy_out(slots, job.payloads)
            return True

        def release(success: bool) -> None:
            with self.lock:
                self.buffer.unpin(job.block_ids)

        self.pool.start(self.jobs, job_id, job.prerequisite, work, release)

    @while_open
    def dump(self, job_id: int, job: JobDescriptor) -> None:
        """Reserves, writes (through to the tier below) and commits on the transfer's outcome."""
        with self.lock:
            self.check_sizes(job)
            slots = self.admit(job.block_ids, None)
            try:
                self.jobs.accept(job_id)
            except Exception:
                self.conclude(job.block_ids, slots, False)
                raise

        def release(success: bool) -> None:
            with self.lock:
                self.conclude(job.block_ids, slots, success)

        self.pool.start(self.jobs, job_id, job.prerequisite, lambda: self.copy_in(slots, job),
                        release)

    def get_finished(self) -> list[IoResult]:
        self.life.require_set_up("get_finished")
        return self.jobs.get_finished()

    def wait(self, job_ids: Sequence[int]) -> list[IoResult]:
        self.life.require_set_up("wait")
        return self.jobs.wait(job_ids)

    def close(self) -> None:
        """Refuses new calls, cancels jobs not yet moving bytes, waits for the rest; idempotent."""
        if self.life.close():
            self.pool.close()

    # -- shared by the facets --------------------------------------------------------------------
    def check_sizes(self, job: JobDescriptor) -> None:
        for block_id, payload in zip(job.block_ids, job.payloads):
            if payload.nbytes != self.block_bytes:
                raise InvalidParam(f"cache: payload of block {block_id.hex()} has "
                                   f"{payload.nbytes} bytes, block_bytes is {self.block_bytes}")

    def copy_out(self, slots: Sequence[int], payloads: Sequence[BlockPayload]) -> None:
        for slot, payload in zip(slots, payloads):
            scatter(self.slab[slot], payload.views())

    def copy_in(self, slots: Sequence[int | None], job: JobDescriptor) -> bool:
        """Writes the sources into the slots, then all blocks to the tier below (a block without
        a slot straight from its source); True if every write did."""
        rows = []
        for slot, payload in zip(slots, job.payloads):
            if slot is None:
                rows.append(payload)
                continue
            gather(payload.views(), self.slab[slot])
            rows.append(BlockPayload([self.slab[slot]]))
        if self.lower is None:
            return True
        return self.lower_transfer("dump", job.block_ids, rows)

    def admit(self, ids: Sequence[BlockId], ttl_ms: int | None) -> list[int | None]:
        """Reserves a slot per block, or None for one that goes only below (see the module doc).

        Without a tier below the batch must fit whole (NoSpace otherwise, nothing reserved).
        """
        if self.lower is None:
            return list(self.buffer.reserve(ids, ttl_ms).slots)
        here = [b for b in ids if b not in self.overflow_allocs]
        slot_of = dict(zip(here, self.buffer.reserve(here, ttl_ms, partial=True).slots))
        slots = [slot_of.get(b) for b in ids]
        for block_id, slot in zip(ids, slots):
            if slot is None:
                self.overflow_allocs[block_id] = self.overflow_allocs.get(block_id, 0) + 1
        return slots

    def conclude(self, ids: Sequence[BlockId], slots: Sequence[int | None],
                 success: bool) -> None:
        """Concludes one admission: commits the blocks given a slot, drops the others' count."""
        self.buffer.commit([b for b, slot in zip(ids, slots) if slot is not None], success)
        self.drop_overflow([b for b, slot in zip(ids, slots) if slot is None])

    def drop_overflow(self, ids: Sequence[BlockId]) -> None:
        for block_id in ids:
            self.overflow_allocs[block_id] -= 1
            if not self.overflow_allocs[block_id]:
                del self.overflow_allocs[block_id]

    def lower_transfer(self, kind: str, ids: list[BlockId], payloads: list[BlockPayload],
                       token: AddressedToken | None = None) -> bool:
        """Runs one load or dump on the tier below and waits for it; this store is its only user.

        A dump on a tokened lower tier is admitted and concluded around the transfer; a load
        uses `token` (the lower tier's pin) when the tier is tokened.
        """
        assert self.lower is not None
        job_id = next(self._lower_job_ids)
        job = JobDescriptor(ids, payloads, description=f"cache {kind} via lower tier")
        facet = self.lower.as_token_addressed()
        if facet is None:
            getattr(self.lower, kind)(job_id, job)
            return self.lower.wait([job_id])[0].success
        if kind == "load":
            facet.load(job_id, job, token or AddressedToken(tuple(ids)))
            return self.lower.wait([job_id])[0].success
        lower_token = facet.alloc(ids, None)
        ok = False
        try:
            facet.dump(job_id, job, lower_token)
            ok = self.lower.wait([job_id])[0].success
        finally:
            facet.commit(ids, ok)
        return ok

    def track(self, job_id: int, ids: Sequence[BlockId], writes: bool,
              on_consumed: Callable[[bool], None] | None = None) -> None:
        """Accepts a job and counts it busy on `ids` until its completion is consumed.

        Reads (loads) guard pins; writes (dumps, prefetches) guard reservations.
        """
        keys = [(writes, block_id) for block_id in ids]

        def release(success: bool) -> None:
            with self.lock:
                for key in keys:
                    self._busy[key] -= 1
                    if not self._busy[key]:
                        del self._busy[key]
            if on_consumed is not None:
                on_consumed(success)

        self.jobs.accept(job_id, release)
        for key in keys:
            self._busy[key] = self._busy.get(key, 0) + 1

    def require_idle(self, ids: Sequence[BlockId], writes: bool, action: str) -> None:
        busy = [block_id for block_id in ids if self._busy.get((writes, block_id))]
        if busy:
            raise InvalidParam(f"cache: {action} of block(s) {ids_hex(busy)} refused: a job on "
                               "them has not been consumed by get_finished/wait yet")

    def mark_written(self, ids: Sequence[BlockId]) -> None:
        with self.lock:
            self._written.update(ids)

    def is_written(self, block_id: BlockId) -> bool:
        return block_id in self._written

    def forget_written(self, ids: Sequence[BlockId]) -> None:
        self._written.difference_update(ids)


class _CacheTokenFacet(TokenAddressed):
    """Pins and two-phase admission for CacheStore; transfers carry the token's keys."""

    def __init__(self, store: CacheStore):
        self._s = store
        self.life = store.life

    @while_open
    def pin(self, ids: Sequence[BlockId]) -> AddressedToken:
        with self._s.lock:
            self._s.buffer.pin(ids)
        return AddressedToken(tuple(ids))

    @while_open
    def unpin(self, ids: Sequence[BlockId]) -> None:
        s = self._s
        with s.lock:
            last = [b for b in ids if s.buffer.pin_count(b) == 1]
            s.require_idle(last, False, "unpin")
            s.buffer.unpin(ids)

    @while_open
    def alloc(self, ids: Sequence[BlockId], ctx: RequestContext | None) -> AddressedToken:
        require_unique(ids, "alloc")
        with self._s.lock:
            self._s.admit(ids, None if ctx is None else ctx.ttl_ms)
        return AddressedToken(tuple(ids))

    @while_open
    def commit(self, ids: Sequence[BlockId], success: bool) -> None:
        s = self._s
        with s.lock:
            require_unique(ids, "commit")
            below = [b for b in ids if b in s.overflow_allocs]
            here = [b for b in ids if b not in s.overflow_allocs]
            for block_id in here:
                if s.buffer.alloc_refs(block_id) == 0:
                    raise InvalidParam(f"commit: block {block_id.hex()} has no outstanding alloc")
            final = ([b for b in here if s.buffer.alloc_refs(b) == 1]
                     + [b for b in below if s.overflow_allocs[b] == 1])
            s.require_idle(final, True, "final commit")
            # A success vote counts only for data a successful dump actually wrote (G2); a block
            # that went only below was committed there by its dump.
            votes = {b: bool(success) and s.is_written(b) for b in here}
            s.forget_written(final)
            s.buffer.commit([b for b in here if votes[b]], True)
            s.buffer.commit([b for b in here if not votes[b]], False)
            s.drop_overflow(below)

    @while_open
    def load(self, job_id: int, job: JobDescriptor, token: AddressedToken) -> None:
        s = self._s
        with s.lock:
            _check_token(job, token)
            unpinned = [b for b in job.block_ids if s.buffer.pin_count(b) == 0]
            if unpinned:
                raise InvalidParam(f"cache: load of unpinned block(s) {ids_hex(unpinned)}; "
                                   "pin them first")
            slots = [s.buffer.slot_of(b) for b in job.block_ids]
            missing = [b for b, slot in zip(job.block_ids, slots) if slot is None]
            if missing:
                raise InvalidParam(f"cache: load of expired block(s) {ids_hex(missing)}")
            s.check_sizes(job)
            s.track(job_id, job.block_ids, writes=False)

        def work() -> bool:
            s.copy_out(slots, job.payloads)
            return True

        s.pool.start(s.jobs, job_id, job.prerequisite, work)

    @while_open
    def dump(self, job_id: int, job: JobDescriptor, token: AddressedToken) -> None:
        s = self._s
        with s.lock:
            _check_token(job, token)
            below = {b for b in job.block_ids if b in s.overflow_allocs}
            slots = [None if b in below else s.buffer.reserved_slot(b) for b in job.block_ids]
            missing = [b for b, slot in zip(job.block_ids, slots)
                       if slot is None and b not in below]
            if missing:
                raise InvalidParam(f"cache: dump of block(s) {ids_hex(missing)} without an "
                                   "outstanding alloc")
            s.check_sizes(job)
            s.track(job_id, job.block_ids, writes=True)

        def work() -> bool:
            ok = s.copy_in(slots, job)
            if ok:
                s.mark_written([b for b, slot in zip(job.block_ids, slots) if slot is not None])
            return ok

        s.pool.start(s.jobs, job_id, job.prerequisite, work)


def _check_token(job: JobDescriptor, token: AddressedToken) -> None:
    if list(token.keys) != list(job.block_ids):
        raise InvalidParam(f"token keys ({ids_hex(token.keys)}) do not match the job's block ids "
                           f"({ids_hex(job.block_ids)})")


def _physical_memory() -> int | None:
    """This machine's RAM in bytes (None where the platform does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
