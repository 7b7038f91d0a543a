"""The checkpoint catalog, its prefix index and the SessionIndex (DESIGN §7): ResourceManager's
logical view of the prefix checkpoints the Program holds.

Owns which checkpoints exist logically, which token prefix each proves, their recency, and
session bindings. Lookup is the longest exact token-prefix match over checkpoint frontiers
(digests narrow the candidates, a token comparison confirms). A session key is a hint, never an
owner: a binding is replaced only by a result with a later publication order. Physical facts
(pages, slots, refcounts) stay with the Program.

Every entry and session binding belongs to a cache scope (a tenant: an API key, a `cache_salt`;
None is the default scope). Lookup, `get` and session bindings never cross scopes, so no request
learns whether another tenant sent a prefix (its `cached_tokens` would tell); two tenants with
the same prefix hold separate checkpoints.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from ninfer_jax.program.checkpoints import CheckpointId


def prefix_digest(tokens, scope: str | None = None) -> str:
    """The catalog key of a token prefix within a cache scope."""
    h = hashlib.blake2b(digest_size=16)
    if scope is not None:
        h.update(b"scope\0" + scope.encode("utf-8", "surrogatepass") + b"\0")
    h.update(np.asarray(tokens, np.int32).tobytes())
    return h.hexdigest()


@dataclasses.dataclass
class CatalogEntry:
    ckpt: CheckpointId
    tokens: tuple[int, ...]
    digest: str
    last_used: int
    scope: str | None = None

    @property
    def frontier(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class CatalogStats:
    checkpoints: int
    hits: int
    misses: int
    captured: int
    evictions: int
    cached_tokens: int  # prefill tokens saved by hits
    pages_held: int = 0  # distinct K/V pages the checkpoints reference
    bytes_held: int = 0  # those pages plus the checkpoints' state images


class CheckpointCatalog:
    """`version` changes whenever a lookup's answer may change (an entry added or removed, a
    session bound): the Engine rechecks a blocked admission only then (DESIGN §4)."""

    def __init__(self) -> None:
        # digest -> entry (one per token prefix), least recently used first
        self._entries: dict[str, CatalogEntry] = {}
        self._lengths: dict[int, int] = {}  # frontier length -> number of entries
        # (scope, session key) -> (digest, publication_order)
        self._sessions: dict[tuple[str | None, str], tuple[str, int]] = {}
        self._clock = itertools.count()
        self.version = 0
        self.hits = self.misses = self.captured = self.evictions = self.cached_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, tokens, scope: str | None = None) -> CatalogEntry | None:
        """The checkpoint of exactly this prefix in `scope`, if cataloged."""
        entry = self._entries.get(prefix_digest(tokens, scope))
        return entry if entry is not None and self._matches(entry, tokens, scope) else None

    @staticmethod
    def _matches(entry: CatalogEntry, tokens, scope: str | None) -> bool:
        return entry.scope == scope and entry.tokens == tuple(tokens)

    def add(self, ckpt: CheckpointId, tokens: tuple[int, ...], scope: str | None = None) -> CatalogEntry:
        entry = CatalogEntry(ckpt, tuple(tokens), prefix_digest(tokens, scope), next(self._clock),
                             scope)
        if entry.digest in self._entries:
            raise ValueError("a checkpoint of this exact prefix is already cataloged")
        self._entries[entry.digest] = entry
        self._lengths[entry.frontier] = self._lengths.get(entry.frontier, 0) + 1
        self.captured += 1
        self.version += 1
        return entry

    def remove(self, entry: CatalogEntry, evicted: bool) -> None:
        del self._entries[entry.digest]
        self._lengths[entry.frontier] -= 1
        if not self._lengths[entry.frontier]:
            del self._lengths[entry.frontier]
        self.evictions += evicted
        self.version += 1

    def lookup(self, tokens, session_key: str | None = None,
               scope: str | None = None) -> CatalogEntry | None:
        """The checkpoint of `scope` with the longest frontier F < len(tokens) whose tokens equal
        tokens[:F] (the session's binding is tried first)."""
        tokens = tuple(tokens)
        candidates = []
        bound = self._sessions.get((scope, session_key)) if session_key is not None else None
        if bound is not None and bound[0] in self._entries:
            candidates.append(self._entries[bound[0]])
        for length in sorted(self._lengths, reverse=True):
            if length < len(tokens):
                entry = self._entries.get(prefix_digest(tokens[:length], scope))
                if entry is not None and self._matches(entry, tokens[:length], scope):
                    candidates.append(entry)
                    break
        best = max((e for e in candidates
                    if e.frontier < len(tokens) and self._matches(e, tokens[: e.frontier], scope)),
                   key=lambda e: e.frontier, default=None)
        return best

    def record_use(self, entry: CatalogEntry | None) -> None:
        if entry is None:
            self.misses += 1
            return
        self.hits += 1
        self.cached_tokens += entry.frontier
        self.touch(entry)

    def touch(self, entry: CatalogEntry) -> None:
        """Marks an entry most recently used (a request reached its prefix again)."""
        entry.last_used = next(self._clock)
        self._entries[entry.digest] = self._entries.pop(entry.digest)

    def bind_session(self, key: str, entry: CatalogEntry, publication_order: int) -> None:
        """Binds `key` in the entry's scope to it, unless a later-ordered result holds it."""
        current = self._sessions.get((entry.scope, key))
        if current is None or publication_order > current[1]:
            self._sessions[(entry.scope, key)] = (entry.digest, publication_order)
            self.version += 1

    def eviction_order(self, keep: CatalogEntry | None = None) -> list[CatalogEntry]:
        """Inactive checkpoints, least recently used first (`keep` excluded)."""
        return [e for e in self._entries.values() if e is not keep]

    def least_recent(self) -> CatalogEntry | None:
        """The first checkpoint of eviction_order(), without building it."""
        return next(iter(self._entries.values()), None)

    def entries(self) -> list[CatalogEntry]:
        return list(self._entries.values())

    def stats(self, pages_held: int = 0, bytes_held: int = 0) -> CatalogStats:
        return CatalogStats(len(self._entries), self.hits, self.misses, self.captured,
                            self.evictions, self.cached_tokens, pages_held, bytes_held)
