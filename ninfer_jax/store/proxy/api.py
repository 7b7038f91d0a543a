"""The two interfaces an engine programs against (DESIGN §11, seed §6.1-6.2).

`StoreScheduler` is the control plane: request register/finish, lookups, touch, and the
prepare/complete windows (at most one open window per kind — get, put, prefetch — per request,
G11). `StoreWorker` is the data plane: jobs by caller-chosen id and token, and their completions,
consumed exactly once (G5). The worker never sees requests; routing facts travel in tokens.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from ninfer_jax.store.types import (
    AddressedToken,
    BlockId,
    BlockPayload,
    IoContext,
    IoResult,
    RequestContext,
)

Keys = Sequence[BlockId] | bytes


class StoreScheduler(abc.ABC):
    @abc.abstractmethod
    def on_new_request(self, ctx: RequestContext) -> None:
        """Registers a request; its facts are snapshotted here for all its windows (G10)."""

    @abc.abstractmethod
    def on_request_finished(self, request_id: str) -> None:
        """Forgets a request, closing leftover windows best-effort (G11)."""

    @abc.abstractmethod
    def lookup(self, request_id: str, keys: Keys) -> list[bool] | None:
        """Hits per key, or None as the prefetch signal."""

    @abc.abstractmethod
    def lookup_on_prefix(self, request_id: str, keys: Keys) -> int | None:
        """Index of the last hit of the contiguous hit prefix, -1 for none, None to prefetch."""

    @abc.abstractmethod
    def lookup_on_reverse(self, request_id: str, keys: Keys) -> int | None:
        """Index of the last hit scanning from the end, -1 for none, None to prefetch."""

    @abc.abstractmethod
    def touch(self, request_id: str, keys: Keys) -> None:
        """Extends retention of the keys by the request's TTL."""

    @abc.abstractmethod
    def prepare_get(self, request_id: str, keys: Keys) -> AddressedToken: ...

    @abc.abstractmethod
    def complete_get(self, request_id: str) -> None: ...

    @abc.abstractmethod
    def prepare_put(self, request_id: str, keys: Keys) -> AddressedToken: ...

    @abc.abstractmethod
    def complete_put(self, request_id: str, success: bool = True) -> None: ...

    @abc.abstractmethod
    def prepare_prefetch(self, request_id: str) -> AddressedToken: ...

    @abc.abstractmethod
    def complete_prefetch(self, request_id: str, success: bool = True) -> None: ...


class StoreWorker(abc.ABC):
    @abc.abstractmethod
    def submit_get(self, job_id: int, payloads: Sequence[BlockPayload], token: AddressedToken,
                   io: IoContext | None = None) -> None: ...

    @abc.abstractmethod
    def submit_put(self, job_id: int, payloads: Sequence[BlockPayload], token: AddressedToken,
                   io: IoContext | None = None) -> None: ...

    @abc.abstractmethod
    def submit_prefetch(self, job_id: int, token: AddressedToken) -> None: ...

    @abc.abstractmethod
    def get_finished(self) -> list[IoResult]: ...

    @abc.abstractmethod
    def wait(self, job_ids: Sequence[int]) -> list[IoResult]: ...


class StoreNode(StoreScheduler, StoreWorker):
    """A topology node implements both planes; `close()` tears it down."""

    @abc.abstractmethod
    def close(self) -> None: ...
