"""StorePeer: requests routed once, at registration, to one of several branches (seed §6.5, G12).

Owns the request -> branch table and the peer-wide job table. Every window of a request goes to
its branch; tokens leaving the peer carry the branch in a frame so the worker side, which never
sees requests, can route jobs:

    offset 0       4                    12
           | UCP1 | branch (u64 LE)    | branch token payload ... |

Unframed, truncated or out-of-range tokens are InvalidParam. Job ids are unique across branches;
get_finished aggregates all branches, wait groups ids by branch. After `close()` (idempotent; the
first call closes every branch) every call but `wait`/`get_finished` raises InvalidParam at once.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Sequence

from ninfer_jax.store.errors import General, InvalidParam, NotFound
from ninfer_jax.store.lifecycle import Lifecycle, while_open
from ninfer_jax.store.proxy.api import Keys, StoreNode
from ninfer_jax.store.proxy.routing import RoutingStrategy
from ninfer_jax.store.types import AddressedToken, BlockPayload, IoContext, IoResult, RequestContext

MAGIC = b"UCP1"
_BRANCH = struct.Struct("<Q")
FRAME_BYTES = len(MAGIC) + _BRANCH.size


def frame_token(branch: int, token: AddressedToken) -> AddressedToken:
    return AddressedToken(token.keys, MAGIC + _BRANCH.pack(branch) + token.payload)


def unframe_token(token: AddressedToken, num_branches: int) -> tuple[int, AddressedToken]:
    payload = token.payload
    if not payload or payload[: len(MAGIC)] != MAGIC[: len(payload)]:
        raise InvalidParam(f"peer: token payload is not framed by this peer (no {MAGIC!r} magic)")
    if len(payload) < FRAME_BYTES:
        raise InvalidParam(f"peer: token frame truncated: {len(payload)} bytes, the frame "
                           f"needs {FRAME_BYTES}")
    (branch,) = _BRANCH.unpack_from(payload, len(MAGIC))
    if branch >= num_branches:
        raise InvalidParam(f"peer: token names branch {branch}, the peer has {num_branches}")
    return branch, AddressedToken(token.keys, payload[FRAME_BYTES:])


class StorePeer(StoreNode):
    def __init__(self, branches: Sequence[StoreNode], strategy: RoutingStrategy):
        if not branches:
            raise InvalidParam("peer: 'branches' must name at least one branch")
        self.branches = list(branches)
        self._strategy = strategy
        self._lock = threading.Lock()
        self._routes: dict[str, int] = {}
        self._jobs: dict[int, int] = {}  # job id -> branch
        self.life = Lifecycle("peer", opened=True)

    # -- control plane --------------------------------------------------------------------------
    @while_open
    def on_new_request(self, ctx: RequestContext) -> None:
        snapshot = ctx.validated()
        branch = self._strategy.select(snapshot)
        if not 0 <= branch < len(self.branches):
            raise General(f"peer: routing chose branch {branch} of {len(self.branches)}")
        with self._lock:
            if snapshot.request_id in self._routes:
                raise InvalidParam(f"request {snapshot.request_id!r} is already registered")
            self._routes[snapshot.request_id] = branch
        try:
            self.branches[branch].on_new_request(snapshot)
        except Exception:
            with self._lock:
                del self._routes[snapshot.request_id]
            raise

    @while_open
    def branch_of(self, request_id: str) -> int:
        with self._lock:
            if request_id not in self._routes:
                raise InvalidParam(f"request {request_id!r} is not registered "
                                   "(on_new_request first)")
            return self._routes[request_id]

    @while_open
    def on_request_finished(self, request_id: str) -> None:
        self.branches[self.branch_of(request_id)].on_request_finished(request_id)
        with self._lock:
            del self._routes[request_id]

    def _node(self, request_id: str) -> StoreNode:
        return self.branches[self.branch_of(request_id)]

    @while_open
    def lookup(self, request_id: str, keys: Keys) -> list[bool] | None:
        return self._node(request_id).lookup(request_id, keys)

    @while_open
    def lookup_on_prefix(self, request_id: str, keys: Keys) -> int | None:
        return self._node(request_id).lookup_on_prefix(request_id, keys)

    @while_open
    def lookup_on_reverse(self, request_id: str, keys: Keys) -> int | None:
        return self._node(request_id).lookup_on_reverse(request_id, keys)

    @while_open
    def touch(self, request_id: str, keys: Keys) -> None:
        self._node(request_id).touch(request_id, keys)

    @while_open
    def prepare_get(self, request_id: str, keys: Keys) -> AddressedToken:
        branch = self.branch_of(request_id)
        return frame_token(branch, self.branches[branch].prepare_get(request_id, keys))

    @while_open
    def prepare_put(self, request_id: str, keys: Keys) -> AddressedToken:
        branch = self.branch_of(request_id)
        return frame_token(branch, self.branches[branch].prepare_put(request_id, keys))

    @while_open
    def prepare_prefetch(self, request_id: str) -> AddressedToken:
        branch = self.branch_of(request_id)
        return frame_token(branch, self.branches[branch].prepare_prefetch(request_id))

    @while_open
    def complete_get(self, request_id: str) -> None:
        self._node(request_id).complete_get(request_id)

    @while_open
    def complete_put(self, request_id: str, success: bool = True) -> None:
        self._node(request_id).complete_put(request_id, success)

    @while_open
    def complete_prefetch(self, request_id: str, success: bool = True) -> None:
        self._node(request_id).complete_prefetch(request_id, success)

    # -- data plane -----------------------------------------------------------------------------
    @while_open
    def submit_get(self, job_id: int, payloads: Sequence[BlockPayload], token: AddressedToken,
                   io: IoContext | None = None) -> None:
        branch, inner = self._claim(job_id, token)
        self._run(job_id, lambda: self.branches[branch].submit_get(job_id, payloads, inner, io))

    @while_open
    def submit_put(self, job_id: int, payloads: Sequence[BlockPayload], token: AddressedToken,
                   io: IoContext | None = None) -> None:
        branch, inner = self._claim(job_id, token)
        self._run(job_id, lambda: self.branches[branch].submit_put(job_id, payloads, inner, io))

    @while_open
    def submit_prefetch(self, job_id: int, token: AddressedToken) -> None:
        branch, inner = self._claim(job_id, token)
        self._run(job_id, lambda: self.branches[branch].submit_prefetch(job_id, inner))

    def _claim(self, job_id: int, token: AddressedToken) -> tuple[int, AddressedToken]:
        branch, inner = unframe_token(token, len(self.branches))
        with self._lock:
            if job_id in self._jobs:
                raise InvalidParam(f"peer: job id {job_id} is already in flight "
                                   f"(on branch {self._jobs[job_id]})")
            self._jobs[job_id] = branch
        return branch, inner

    def _run(self, job_id: int, submit) -> None:
        try:
            submit()
        except Exception:
            with self._lock:
                del self._jobs[job_id]
            raise

    def get_finished(self) -> list[IoResult]:
        results = [r for branch in self.branches for r in branch.get_finished()]
        with self._lock:
            for result in results:
                self._jobs.pop(result.job_id, None)
        return results

    def wait(self, job_ids: Sequence[int]) -> list[IoResult]:
        job_ids = list(job_ids)
        groups: dict[int, list[int]] = {}
        with self._lock:
            for job_id in job_ids:
                if job_id not in self._jobs:
                    raise NotFound(f"peer: job id {job_id} is not in flight")
                groups.setdefault(self._jobs[job_id], []).append(job_id)
        by_id = {r.job_id: r for b, ids in groups.items() for r in self.branches[b].wait(ids)}
        with self._lock:
            for job_id in job_ids:
                self._jobs.pop(job_id, None)
        return [by_id[j] for j in job_ids]

    def close(self) -> None:
        if self.life.close():
            for branch in self.branches:
                branch.close()
