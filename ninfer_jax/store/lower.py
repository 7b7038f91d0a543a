"""A store's view of the tier below it in a pipe (`piped_lower_store`, DESIGN §11, G14).

`LowerTier` runs one transfer at a time on the lower tier and waits for it: write-through dumps
and reads from below happen on the upper store's own transfer threads. It owns the job ids it
uses there (the upper store is the lower tier's only transfer user, so a private counter cannot
collide) and the lower tier's protocol: on a tokened tier a dump is admitted (`alloc`) and
concluded (`commit`) around the transfer, and a load runs under a pin, the caller's (a prefetch
plan's) or one taken and dropped around the load; an untokened tier gets its base load/dump.
A block gone from below between a lookup and its pin is a failed transfer, not an error.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ninfer_jax.store.base import Store
from ninfer_jax.store.errors import InvalidParam, NotFound
from ninfer_jax.store.types import AddressedToken, BlockId, BlockPayload, JobDescriptor, ids_hex

_log = logging.getLogger(__name__)
FIELD = "piped_lower_store"


class LowerTier:
    def __init__(self, owner: str, store: Store):
        self.owner = owner
        self.store = store
        self._job_ids = itertools.count()

    @classmethod
    def from_config(cls, config: Mapping[str, Any], owner: str) -> LowerTier | None:
        """The tier a pipe injected as `piped_lower_store`, or None for the last tier."""
        lower = config.get(FIELD)
        if lower is None:
            return None
        if not isinstance(lower, Store):
            raise InvalidParam(f"{owner}: config field {FIELD!r} must be a Store, "
                               f"got {type(lower).__name__}")
        return cls(owner, lower)

    def lookup(self, ids: Sequence[BlockId]) -> list[bool]:
        """The lower tier's own lookup (for a middle tier: its blocks and those below it)."""
        return self.store.lookup(ids) if ids else []

    def pin(self, ids: Sequence[BlockId]) -> bool:
        """Pins `ids` below if that tier is tokened (atomic, NotFound if one is gone)."""
        facet = self.store.as_token_addressed()
        if facet is None:
            return False
        facet.pin(ids)
        return True

    def unpin(self, ids: Sequence[BlockId]) -> None:
        facet = self.store.as_token_addressed()
        if facet is not None:
            facet.unpin(ids)

    def load(self, ids: list[BlockId], payloads: list[BlockPayload], pinned: bool) -> bool:
        """Reads `ids` from below into `payloads`; `pinned`: the caller holds pins on them."""
        facet = self.store.as_token_addressed()
        if facet is None:
            return self._run("load", self.store.load, ids, payloads)
        if pinned:
            return self._run("load", lambda j, job: facet.load(j, job, AddressedToken(tuple(ids))),
                             ids, payloads)
        try:
            facet.pin(ids)
        except NotFound as e:
            _log.info("%s: block(s) %s left the tier below before their read: %s", self.owner,
                      ids_hex(ids), e)
            return False
        try:
            return self._run("load", lambda j, job: facet.load(j, job, AddressedToken(tuple(ids))),
                             ids, payloads)
        finally:
            facet.unpin(ids)

    def dump(self, ids: list[BlockId], payloads: list[BlockPayload]) -> bool:
        """Stores `ids` below; True once the tier below committed every one of them."""
        facet = self.store.as_token_addressed()
        if facet is None:
            return self._run("dump", self.store.dump, ids, payloads)
        token = facet.alloc(ids, None)
        ok = False
        try:
            ok = self._run("dump", lambda j, job: facet.dump(j, job, token), ids, payloads)
        finally:
            facet.commit(ids, ok)
        return ok

    def _run(self, kind: str, submit: Callable[[int, JobDescriptor], None], ids: list[BlockId],
             payloads: list[BlockPayload]) -> bool:
        job_id = next(self._job_ids)
        submit(job_id, JobDescriptor(ids, payloads, description=f"{self.owner} {kind} below"))
        return self.store.wait([job_id])[0].success
