"""Deadline bookkeeping for CacheBuffer's TTL (DESIGN §11, G9).

An `ExpiryQueue` is a min-heap of (deadline, seq, block id) that is never updated in place: a new
deadline pushes a new item, and a popped item is honoured only if the block still carries that
exact deadline (stale items are dropped then, and the whole heap is compacted when stale items
outnumber live ones). Expired blocks that are pinned cannot be freed yet; they wait in `deferred`
and are re-examined on every sweep. The queue decides nothing about visibility; CacheBuffer does.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable

from ninfer_jax.store.types import BlockId

_COMPACT_SLACK = 64


class ExpiryQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, BlockId]] = []
        self._seq = itertools.count()
        self.deferred: set[BlockId] = set()

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, block_id: BlockId, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, next(self._seq), block_id))

    def pop_due(self, now: float, deadline_of: Callable[[BlockId], float | None]) -> list[BlockId]:
        """Ids whose current deadline is <= now (each once), dropping stale heap items."""
        due: dict[BlockId, None] = {}  # a deadline set twice has two items: report the id once
        while self._heap and self._heap[0][0] <= now:
            deadline, _, block_id = heapq.heappop(self._heap)
            if deadline_of(block_id) == deadline:
                due[block_id] = None
        return list(due)

    def maybe_compact(self, live: Iterable[tuple[BlockId, float]], num_live: int) -> None:
        """Rebuilds the heap from the live deadlines when stale items dominate."""
        if len(self._heap) <= 2 * num_live + _COMPACT_SLACK:
            return
        self._heap = [(deadline, next(self._seq), block_id) for block_id, deadline in live]
        heapq.heapify(self._heap)
