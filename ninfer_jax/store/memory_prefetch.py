"""CacheStore's Prefetchable facet: bringing blocks up from the tier directly below (seed §5.4).

Owns the per-request prefetch signals and the prefetch plans. `lookup` answers hits, or None
when some missing block is present below; `prepare_prefetch` pins the sources below (when that
tier is tokened) and admits the destinations here with the request's TTL, so prefetched blocks
inherit the window's TTL (G9); `prefetch` moves the bytes straight into the slab; and
`complete_prefetch` commits only if every prefetch job of the plan succeeded (G2), refusing while
a job of the plan has not been consumed (G4).
"""

from __future__ import annotations

import dataclasses
import itertools
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ninfer_jax.store.base import Prefetchable
from ninfer_jax.store.errors import InvalidParam, NotFound, StoreError
from ninfer_jax.store.lifecycle import while_open
from ninfer_jax.store.types import AddressedToken, BlockId, BlockPayload, RequestContext

if TYPE_CHECKING:
    from ninfer_jax.store.memory import CacheStore

_PLAN = struct.Struct("<Q")


@dataclasses.dataclass
class _Plan:
    request_id: str
    ids: list[BlockId]
    slots: list[int]
    lower_pinned: bool
    running: set[int] = dataclasses.field(default_factory=set)
    num_ok: int = 0
    num_failed: int = 0


class CachePrefetch(Prefetchable):
    def __init__(self, store: CacheStore):
        self._s = store
        self.life = store.life
        self._signals: dict[str, list[BlockId]] = {}
        self._plans: dict[int, _Plan] = {}
        self._plan_numbers = itertools.count()

    @while_open
    def lookup(self, request_id: str, ids: Sequence[BlockId]) -> list[bool] | None:
        s = self._s
        assert s.lower is not None
        with s.lock:
            hits = s.buffer.lookup(ids)
            missing = [b for b, hit in zip(ids, hits) if not hit]
            below = s.lower.lookup(missing) if missing else []
            prefetchable = [b for b, hit in zip(missing, below) if hit]
            if prefetchable:
                self._signals[request_id] = prefetchable
                return None
            self._signals.pop(request_id, None)
            return hits

    @while_open
    def prepare_prefetch(self, request_id: str, ctx: RequestContext) -> AddressedToken:
        s = self._s
        assert s.lower is not None
        with s.lock:
            ids = self._signals.get(request_id)
            if ids is None:
                raise InvalidParam(f"cache: request {request_id!r} has no pending prefetch "
                                   "signal; a lookup must return None first")
            facet = s.lower.as_token_addressed()
            if facet is not None:
                facet.pin(ids)
            try:
                slots = list(s.buffer.reserve(ids, ctx.ttl_ms).slots)
            except StoreError:
                if facet is not None:
                    facet.unpin(ids)
                raise
            del self._signals[request_id]
            number = next(self._plan_numbers)
            self._plans[number] = _Plan(request_id, ids, slots, facet is not None)
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
