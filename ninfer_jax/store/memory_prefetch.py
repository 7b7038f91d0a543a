"""CacheStore's Prefetchable facet: bringing blocks up from the tier directly below (seed §5.4).

Owns the per-request prefetch signals and the prefetch plans. `prepare_prefetch` pins the sources
below (when that tier is tokened) and admits the destinations here with the request's TTL, so
prefetched blocks inherit the window's TTL (G9); `prefetch` moves the bytes straight into the
slab; and `complete_prefetch` commits only if every prefetch job of the plan succeeded (G2),
refusing while a job of the plan has not been consumed (G4).

Which blocks a lookup plans for (so that lookup -> prefetch -> lookup converges). The lookup walks
its ids in the order given, spending the slots a reservation could take now (free, or holding an
unpinned committed block) on them:
- a hit here is kept: the plan pins it for its whole life, so the plan's own reservation never
  evicts a block the lookup counted (an unpinned hit costs one slot, a pinned one none);
- a block missing here that the tier below holds is fetched, at one slot;
- a block being written here by another job (reserved, not committed) is neither: it is a miss
  until that job commits it;
- once the slots are spent, later blocks are left as they are (a later unpinned hit may become a
  victim of the plan's reservation).
With `prefix=True` (lookup_on_prefix) the walk also stops at the first block that neither is here
nor can be fetched, or that no longer fits, since nothing after it extends the prefix: the head is
spent on the prefix alone. The lookup signals (returns None) only when the walk fetches at least
one block; otherwise it answers the hits as they stand. So a prefix longer than the head can hold
answers the longest prefix the head can serve, and after one successful prefetch the same lookup
answers (unless other requests evicted or pinned blocks meanwhile). `prepare_prefetch` walks again
under the lock, so the plan matches the state it reserves against.
"""

from __future__ import annotations

import dataclasses
import itertools
import struct
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from ninfer_jax.store.base import Prefetchable, Store
from ninfer_jax.store.cache_buffer import CacheBuffer
from ninfer_jax.store.errors import InvalidParam, NotFound, StoreError
from ninfer_jax.store.jobs import JobTable
from ninfer_jax.store.lifecycle import Lifecycle, while_open
from ninfer_jax.store.transfer import TransferPool
from ninfer_jax.store.types import AddressedToken, BlockId, BlockPayload, RequestContext

_PLAN = struct.Struct("<Q")


class CacheParts(Protocol):
    """What the facet uses of its CacheStore (`memory.py`), and nothing else."""

    lock: Any  # the store's RLock: guards the buffer and the jobs
    life: Lifecycle
    buffer: CacheBuffer
    slab: np.ndarray  # [capacity, block_bytes] uint8, one row per slot
    jobs: JobTable
    pool: TransferPool
    lower: Store | None

    def lower_transfer(self, kind: str, ids: list[BlockId], payloads: list[BlockPayload],
                       token: AddressedToken | None = None) -> bool: ...

    def track(self, job_id: int, ids: Sequence[BlockId], writes: bool,
              on_consumed: Callable[[bool], None] | None = None) -> None: ...


@dataclasses.dataclass(frozen=True)
class _Signal:
    """What a signalling lookup asked for; the plan is walked again from it at prepare time."""

    ids: list[BlockId]
    prefix: bool


@dataclasses.dataclass
class _Plan:
    request_id: str
    ids: list[BlockId]  # fetched: reserved here, pinned below when that tier is tokened
    slots: list[int]
    kept: list[BlockId]  # hits pinned here for the plan's life
    lower_pinned: bool
    running: set[int] = dataclasses.field(default_factory=set)
    num_ok: int = 0
    num_failed: int = 0


class CachePrefetch(Prefetchable):
    def __init__(self, store: CacheParts):
        self._s = store
        self.life = store.life
        self._signals: dict[str, _Signal] = {}
        self._plans: dict[int, _Plan] = {}
        self._plan_numbers = itertools.count()

    @while_open
    def lookup(self, request_id: str, ids: Sequence[BlockId],
               prefix: bool = False) -> list[bool] | None:
        ids = list(ids)
        with self._s.lock:
            hits, _, fetch = self._walk(ids, prefix)
            if fetch:
                self._signals[request_id] = _Signal(ids, prefix)
                return None
            self._signals.pop(request_id, None)
            return hits

    def _walk(self, ids: list[BlockId],
              prefix: bool) -> tuple[list[bool], list[BlockId], list[BlockId]]:
        """(hits, kept, fetched) for `ids` as the module docstring says; caller holds the lock."""
        s = self._s
        assert s.lower is not None
        buffer = s.buffer
        hits = buffer.lookup(ids)
        absent = [b for b, hit in zip(ids, hits) if not hit and not buffer.is_pending(b)]
        below = dict(zip(absent, s.lower.lookup(absent))) if absent else {}
        room = buffer.num_placeable()
        kept: list[BlockId] = []
        fetch: list[BlockId] = []
        seen: set[BlockId] = set()
        for block_id, hit in zip(ids, hits):
            if block_id in seen:
                continue
            seen.add(block_id)
            if hit:
                cost = 0 if buffer.is_guarded(block_id) else 1
            elif below.get(block_id, False):
                cost = 1
            elif prefix:
                break
            else:
                continue
            if cost > room:
                if prefix:
                    break
                continue
            room -= cost
            (kept if hit else fetch).append(block_id)
        return hits, kept, fetch

    @while_open
    def prepare_prefetch(self, request_id: str, ctx: RequestContext) -> AddressedToken:
        s = self._s
        assert s.lower is not None
        with s.lock:
            signal = self._signals.get(request_id)
            if signal is None:
                raise InvalidParam(f"cache: request {request_id!r} has no pending prefetch "
                                   "signal; a lookup must return None first")
            _, kept, fetch = self._walk(signal.ids, signal.prefix)
            s.buffer.pin(kept)
            try:
                reservation = s.buffer.reserve(fetch, ctx.ttl_ms, partial=True)
            except StoreError:
                s.buffer.unpin(kept)
                raise
            ids = [b for b, slot in zip(fetch, reservation.slots) if slot is not None]
            slots = [slot for slot in reservation.slots if slot is not None]
            facet = s.lower.as_token_addressed()
            if facet is not None and ids:
                try:
                    facet.pin(ids)
                except StoreError:
                    s.buffer.commit(ids, False)
                    s.buffer.unpin(kept)
                    raise
            del self._signals[request_id]
            number = next(self._plan_numbers)
            self._plans[number] = _Plan(request_id, ids, slots, kept,
                                        facet is not None and bool(ids))
            return AddressedToken(tuple(ids), _PLAN.pack(number))

    @while_open
    def prefetch(self, job_id: int, plan: AddressedToken) -> None:
        s = self._s
        with s.lock:
            _, record = self._plan(plan)
            record.running.add(job_id)

            def consumed(success: bool) -> None:
                with s.lock:
                    record.running.discard(job_id)
                    if success:
                        record.num_ok += 1
                    else:
                        record.num_failed += 1

            try:
                s.track(job_id, record.ids, True, consumed)
            except StoreError:
                record.running.discard(job_id)
                raise
        rows = [BlockPayload([s.slab[slot]]) for slot in record.slots]
        pin_token = AddressedToken(tuple(record.ids)) if record.lower_pinned else None
        s.pool.start(s.jobs, job_id, None,
                     lambda: s.lower_transfer("load", record.ids, rows, pin_token))

    @while_open
    def forget(self, request_id: str) -> None:
        with self._s.lock:
            self._signals.pop(request_id, None)

    @while_open
    def complete_prefetch(self, plan: AddressedToken, success: bool) -> None:
        s = self._s
        assert s.lower is not None
        with s.lock:
            number, record = self._plan(plan)
            if record.running:
                raise InvalidParam(f"cache: complete_prefetch of plan for request "
                                   f"{record.request_id!r} refused: job(s) "
                                   f"{sorted(record.running)} not consumed yet")
            ok = bool(success) and record.num_ok > 0 and record.num_failed == 0
            s.buffer.commit(record.ids, ok)
            s.buffer.unpin(record.kept)
            del self._plans[number]
            if record.lower_pinned:
                facet = s.lower.as_token_addressed()
                assert facet is not None
                facet.unpin(record.ids)

    def _plan(self, plan: AddressedToken) -> tuple[int, _Plan]:
        if len(plan.payload) != _PLAN.size:
            raise InvalidParam(f"cache: prefetch plan payload must be {_PLAN.size} bytes, "
                               f"got {len(plan.payload)}")
        (number,) = _PLAN.unpack(plan.payload)
        record = self._plans.get(number)
        if record is None:
            raise NotFound(f"cache: prefetch plan {number} is unknown or already completed")
        return number, record
