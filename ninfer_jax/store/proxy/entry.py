"""StoreEntry: the scheduler and worker interfaces over one store (seed §6.3).

Owns the request table (facts snapshot + open windows per request) and the entry-level job table.
Dispatches by capability: lookups go to the Prefetchable facet when present, else the base
lookup; transfers go to the TokenAddressed facet when present, else the base load/dump. For an
untokened store, prepare_get/put mint keys-only tokens without calling the store; for a store
that cannot prefetch, submit_prefetch synthesizes a successful completion. Leftover windows are
closed best-effort when a request finishes (G11): a window with no unconsumed job at once; one
with unconsumed jobs when the last of them is consumed by get_finished/wait (G4: a slot is never
released under a transfer, and never left held once its jobs are consumed). A window waits for
every job submitted on its token (the one prepare_* returned; one submitted on a finished
request's token too) and every other job on one of its blocks: the store refuses a final commit
under any unconsumed write of the block, e.g. another request's prefetch of it (`_holding`;
the jobs on its blocks are looked up again when the last one it waited for is consumed). After
`close()` (idempotent; the first call closes the store) every call but `wait`/`get_finished`
raises InvalidParam at once, the completions of jobs that were in flight stay consumable, and
releases still waiting on them are dropped with the store.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence

from ninfer_jax.store.base import Store, lookup_on_prefix, lookup_on_reverse
from ninfer_jax.store.errors import InvalidParam, NotFound, StoreError
from ninfer_jax.store.jobs import JobTable
from ninfer_jax.store.lifecycle import Lifecycle, State, while_open
from ninfer_jax.store.proxy.api import Keys, StoreNode
from ninfer_jax.store.types import (
    AddressedToken,
    BlockPayload,
    IoContext,
    IoResult,
    JobDescriptor,
    RequestContext,
    as_block_ids,
)

_log = logging.getLogger(__name__)
WINDOW_KINDS = ("get", "put", "prefetch")


@dataclasses.dataclass
class _Request:
    ctx: RequestContext
    windows: dict[str, AddressedToken] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class _Job:
    synthesized: bool  # completed here (a prefetch on a store that cannot prefetch)
    token: AddressedToken


@dataclasses.dataclass
class _Deferred:
    """A finished request's window, released once every job in `pending` is consumed."""

    request_id: str
    kind: str
    token: AddressedToken
    pending: set[int]


class StoreEntry(StoreNode):
    def __init__(self, store: Store):
        self.store = store
        self._tokened = store.as_token_addressed()
        self._prefetchable = store.as_prefetchable()
        self._lock = threading.RLock()
        self._requests: dict[str, _Request] = {}
        self._in_flight: dict[int, _Job] = {}
        self._deferred: list[_Deferred] = []
        self._synthesized = JobTable(f"{store.name} entry")
        self.life = Lifecycle(f"{store.name} entry", opened=True)

    # -- requests -------------------------------------------------------------------------------
    @while_open
    def on_new_request(self, ctx: RequestContext) -> None:
        snapshot = ctx.validated()
        with self._lock:
            if snapshot.request_id in self._requests:
                raise InvalidParam(f"request {snapshot.request_id!r} is already registered")
            self._requests[snapshot.request_id] = _Request(snapshot)

    @while_open
    def on_request_finished(self, request_id: str) -> None:
        with self._lock:
            request = self._request(request_id)
            for kind in WINDOW_KINDS:
                token = request.windows.pop(kind, None)
                if token is None:
                    continue
                pending = self._holding(token)
                if pending:
                    self._deferred.append(_Deferred(request_id, kind, token, pending))
                else:
                    self._release_leftover(request_id, kind, token)
            del self._requests[request_id]
        if self._prefetchable is not None:
            self._prefetchable.forget(request_id)

    @while_open
    def context(self, request_id: str) -> RequestContext:
        with self._lock:
            return self._request(request_id).ctx

    # -- lookups --------------------------------------------------------------------------------
    @while_open
    def lookup(self, request_id: str, keys: Keys) -> list[bool] | None:
        return self._lookup(request_id, keys, prefix=False)

    @while_open
    def lookup_on_prefix(self, request_id: str, keys: Keys) -> int | None:
        return lookup_on_prefix(self._lookup(request_id, keys, prefix=True))

    @while_open
    def lookup_on_reverse(self, request_id: str, keys: Keys) -> int | None:
        return lookup_on_reverse(self.lookup(request_id, keys))

    def _lookup(self, request_id: str, keys: Keys, prefix: bool) -> list[bool] | None:
        ids = as_block_ids(keys)
        with self._lock:
            self._request(request_id)
        if self._prefetchable is not None:
            return self._prefetchable.lookup(request_id, ids, prefix)
        return self.store.lookup(ids)

    @while_open
    def touch(self, request_id: str, keys: Keys) -> None:
        ids = as_block_ids(keys)
        self.store.touch(ids, self.context(request_id).ttl_ms)

    # -- windows --------------------------------------------------------------------------------
    @while_open
    def prepare_get(self, request_id: str, keys: Keys) -> AddressedToken:
        ids = as_block_ids(keys)
        return self._open(request_id, "get", lambda ctx: (
            self._tokened.pin(ids) if self._tokened else AddressedToken(tuple(ids))))

    @while_open
    def prepare_put(self, request_id: str, keys: Keys) -> AddressedToken:
        ids = as_block_ids(keys)
        return self._open(request_id, "put", lambda ctx: (
            self._tokened.alloc(ids, ctx) if self._tokened else AddressedToken(tuple(ids))))

    @while_open
    def prepare_prefetch(self, request_id: str) -> AddressedToken:
        return self._open(request_id, "prefetch", lambda ctx: (
            self._prefetchable.prepare_prefetch(request_id, ctx) if self._prefetchable
            else AddressedToken(())))

    @while_open
    def complete_get(self, request_id: str) -> None:
        self._complete(request_id, "get", True)

    @while_open
    def complete_put(self, request_id: str, success: bool = True) -> None:
        self._complete(request_id, "put", success)

    @while_open
    def complete_prefetch(self, request_id: str, success: bool = True) -> None:
        self._complete(request_id, "prefetch", success)

    def _open(self, request_id: str, kind: str, mint) -> AddressedToken:
        with self._lock:
            request = self._request(request_id)
            if kind in request.windows:
                raise InvalidParam(f"request {request_id!r} already has an open {kind} window")
            token = mint(request.ctx)
            request.windows[kind] = token
            return token

    def _complete(self, request_id: str, kind: str, success: bool) -> None:
        with self._lock:
            request = self._request(request_id)
            if kind not in request.windows:
                raise InvalidParam(f"request {request_id!r} has no open {kind} window")
            self._close_window(request, kind, success)

    def _close_window(self, request: _Request, kind: str, success: bool) -> None:
        """Releases the window's store state; the window stays open if the store refuses."""
        self._release_window(kind, request.windows[kind], success)
        del request.windows[kind]

    def _release_leftover(self, request_id: str, kind: str, token: AddressedToken) -> None:
        """Best-effort release of a finished request's window (G11): a refusal is logged."""
        try:
            self._release_window(kind, token, success=False)
        except StoreError as e:
            _log.warning("request %r: leftover %s window not released: %s", request_id, kind, e)

    def _release_window(self, kind: str, token: AddressedToken, success: bool) -> None:
        if kind == "get" and self._tokened:
            self._tokened.unpin(token.keys)
        elif kind == "put" and self._tokened:
            self._tokened.commit(token.keys, success)
        elif kind == "prefetch" and self._prefetchable:
            self._prefetchable.complete_prefetch(token, success)

    def _request(self, request_id: str) -> _Request:
        request = self._requests.get(request_id)
        if request is None:
            raise InvalidParam(f"request {request_id!r} is not registered (on_new_request first)")
        return request

    # -- data plane -----------------------------------------------------------------------------
    @while_open
    def submit_get(self, job_id: int, payloads: Sequence[BlockPayload], token: AddressedToken,
                   io: IoContext | None = None) -> None:
        self._submit("load", job_id, payloads, token, io)

    @while_open
    def submit_put(self, job_id: int, payloads: Sequence[BlockPayload], token: AddressedToken,
                   io: IoContext | None = None) -> None:
        self._submit("dump", job_id, payloads, token, io)

    @while_open
    def submit_prefetch(self, job_id: int, token: AddressedToken) -> None:
        self._claim(job_id, _Job(self._prefetchable is None, token))
        try:
            if self._prefetchable is None:
                self._synthesized.accept(job_id)
                self._synthesized.finish(job_id, True)
            else:
                self._prefetchable.prefetch(job_id, token)
        except Exception:
            self._release(job_id)
            raise

    def _submit(self, kind: str, job_id: int, payloads: Sequence[BlockPayload],
                token: AddressedToken, io: IoContext | None) -> None:
        if len(payloads) != len(token.keys):
            raise InvalidParam(f"job {job_id}: {len(payloads)} payloads for a token of "
                               f"{len(token.keys)} keys")
        if self._tokened is None and token.payload:
            raise InvalidParam(f"job {job_id}: store {self.store.name!r} is untokened but the "
                               "token carries a payload")
        job = JobDescriptor(list(token.keys), list(payloads),
                            prerequisite=None if io is None else io.prerequisite)
        self._claim(job_id, _Job(False, token))
        try:
            if self._tokened is not None:
                getattr(self._tokened, kind)(job_id, job, token)
            else:
                getattr(self.store, kind)(job_id, job)
        except Exception:
            self._release(job_id)
            raise

    def _claim(self, job_id: int, job: _Job) -> None:
        with self._lock:
            if job_id in self._in_flight:
                raise InvalidParam(f"job id {job_id} is already in flight")
            self._in_flight[job_id] = job

    def _release(self, job_id: int) -> None:
        """Forgets a consumed (or refused) job; releases the deferred windows it held last."""
        with self._lock:
            self._in_flight.pop(job_id, None)
            if self.life.state is State.CLOSED:
                self._deferred.clear()
                return
            for deferred in list(self._deferred):
                deferred.pending.discard(job_id)
                if not deferred.pending:  # or jobs on its token or blocks submitted since
                    deferred.pending = self._holding(deferred.token)
                if not deferred.pending:
                    self._deferred.remove(deferred)
                    self._release_leftover(deferred.request_id, deferred.kind, deferred.token)

    def _holding(self, token: AddressedToken) -> set[int]:
        """The unconsumed jobs a finished request's window waits for before its release: those
        submitted on its token and those on any of its blocks."""
        keys = set(token.keys)
        return {j for j, job in self._in_flight.items()
                if job.token == token or not keys.isdisjoint(job.token.keys)}

    def get_finished(self) -> list[IoResult]:
        results = self.store.get_finished() + self._synthesized.get_finished()
        for result in results:
            self._release(result.job_id)
        return results

    def wait(self, job_ids: Sequence[int]) -> list[IoResult]:
        job_ids = list(job_ids)
        with self._lock:
            for job_id in job_ids:
                if job_id not in self._in_flight:
                    raise NotFound(f"job id {job_id} is not in flight")
            synthesized = [j for j in job_ids if self._in_flight[j].synthesized]
        stored = [j for j in job_ids if j not in synthesized]
        by_id = {r.job_id: r for r in self.store.wait(stored) + self._synthesized.wait(synthesized)}
        for job_id in job_ids:
            self._release(job_id)
        return [by_id[j] for j in job_ids]

    def close(self) -> None:
        if self.life.close():
            self.store.close()
