"""The Store interface and its two optional facets (DESIGN §11, seed §5).

`Store` is the base every tier implements: `setup(config)`, `lookup(ids) -> hits`, async
`load`/`dump` that return once the job is accepted and started (success comes with the
completion, G6), `get_finished()`/`wait(ids)` consuming each completion exactly once (G5),
`touch`, and `close()`. Capabilities are discovered, not assumed: `as_token_addressed()` and
`as_prefetchable()` return a facet object or None, and live as long as the store.

Thread contract: every method may be called from any thread; stores serialize their own state.
Life (lifecycle.py): before `setup` and after `close` every call but `close`, `wait` and
`get_finished` raises InvalidParam at once. Closing a store is idempotent: it cancels the jobs
that have not begun moving bytes (they complete with success=False) and waits for the rest.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

from ninfer_jax.store.types import (
    AddressedToken,
    BlockId,
    IoResult,
    JobDescriptor,
    RequestContext,
)


class Store(abc.ABC):
    """One storage tier addressed by BlockId."""

    name: str = "store"

    @abc.abstractmethod
    def setup(self, config: Mapping[str, Any]) -> None:
        """Validates `config` and acquires resources; a bad field is InvalidParam naming it."""

    @abc.abstractmethod
    def lookup(self, ids: Sequence[BlockId]) -> list[bool]:
        """Which of `ids` are committed here (hits are decided by id alone, G1)."""

    @abc.abstractmethod
    def load(self, job_id: int, job: JobDescriptor) -> None:
        """Starts copying each block into `job.payloads[i]`; success arrives with the completion."""

    @abc.abstractmethod
    def dump(self, job_id: int, job: JobDescriptor) -> None:
        """Starts storing `job.payloads[i]` as block `job.block_ids[i]`."""

    @abc.abstractmethod
    def get_finished(self) -> list[IoResult]:
        """Consumes every finished completion."""

    @abc.abstractmethod
    def wait(self, job_ids: Sequence[int]) -> list[IoResult]:
        """Blocks for and consumes the listed completions; an unknown id is NotFound."""

    def touch(self, ids: Sequence[BlockId], ttl_ms: int | None) -> None:
        """Extends retention of committed blocks; stores without retention keep this no-op."""
        del ids, ttl_ms

    def close(self) -> None:
        """Cancels jobs not yet moving bytes, waits for the rest, releases resources; idempotent."""

    def as_token_addressed(self) -> TokenAddressed | None:
        return None

    def as_prefetchable(self) -> Prefetchable | None:
        return None


class TokenAddressed(abc.ABC):
    """Addressing facet: pins for reads, two-phase admission for writes (G2-G4, G7)."""

    @abc.abstractmethod
    def pin(self, ids: Sequence[BlockId]) -> AddressedToken:
        """Pins committed blocks against eviction; atomic, a missing id is NotFound (G3)."""

    @abc.abstractmethod
    def unpin(self, ids: Sequence[BlockId]) -> None:
        """Releases pins; idempotent. Refused while a load of a block is unconsumed (G4)."""

    @abc.abstractmethod
    def alloc(self, ids: Sequence[BlockId], ctx: RequestContext | None) -> AddressedToken:
        """Reserves space invisibly to lookup; atomic; concurrent allocs share (G7)."""

    @abc.abstractmethod
    def commit(self, ids: Sequence[BlockId], success: bool) -> None:
        """Concludes one alloc per id: the last commit decides, any success commits (G7)."""

    @abc.abstractmethod
    def load(self, job_id: int, job: JobDescriptor, token: AddressedToken) -> None:
        """Token-carrying load; completion through the store's get_finished/wait."""

    @abc.abstractmethod
    def dump(self, job_id: int, job: JobDescriptor, token: AddressedToken) -> None:
        """Token-carrying dump; completion through the store's get_finished/wait."""


class Prefetchable(abc.ABC):
    """Prefetch facet: a lookup may answer "missing here, prefetchable from below" (G13).

    Protocol: lookup -> None; prepare_prefetch -> plan; prefetch(job, plan); wait;
    complete_prefetch(plan, ok); lookup -> hits. `request_id` joins the steps; it names one set
    of blocks, and state is dropped once final hits are returned. The loop must converge: a
    lookup signals only when a prefetch would add hits without evicting the ones it counted.
    """

    @abc.abstractmethod
    def lookup(self, request_id: str, ids: Sequence[BlockId],
               prefix: bool = False) -> list[bool] | None:
        """Hits, or None as the prefetch signal; errors raise (separate channels, G13).

        `prefix=True` says only the contiguous hit prefix matters (lookup_on_prefix), so a
        prefetch is planned for the prefix alone.
        """

    @abc.abstractmethod
    def prepare_prefetch(self, request_id: str, ctx: RequestContext) -> AddressedToken:
        """Pins the sources below and admits destinations here with the request's TTL (G9)."""

    @abc.abstractmethod
    def prefetch(self, job_id: int, plan: AddressedToken) -> None:
        """Starts moving the plan's blocks up; completion through the store's get_finished/wait."""

    @abc.abstractmethod
    def complete_prefetch(self, plan: AddressedToken, success: bool) -> None:
        """Commits (or rolls back) the destinations and unpins the sources."""

    def forget(self, request_id: str) -> None:
        """Drops the prefetch signal a lookup of the finished request left (idempotent)."""
        del request_id


def lookup_on_prefix(hits: list[bool] | None) -> int | None:
    """Index of the last hit of the contiguous hit prefix, -1 for none, None passes the signal."""
    if hits is None:
        return None
    count = 0
    for hit in hits:
        if not hit:
            break
        count += 1
    return count - 1


def lookup_on_reverse(hits: list[bool] | None) -> int | None:
    """Index of the last hit found scanning from the end, -1 for none, None passes the signal.

    With stores that keep a request's prefix whole, this is the prefix length minus one found
    from the far end, the cheap probe for long histories.
    """
    if hits is None:
        return None
    for i in range(len(hits) - 1, -1, -1):
        if hits[i]:
            return i
    return -1
