"""ResourceManager (DESIGN §2, §3, §7): logical lanes, the checkpoint catalog (its prefix
index and SessionIndex), and their adoption of Program results.

Owns lanes: `Free -> Materializing -> Active -> TerminalPending -> Free`. A lane is a logical
claim, not a slot, page or batch row; the Program owns those and is asked, never mirrored: it
alone answers whether a sequence fits, which checkpoints to release for it and the backfill
proof (`HostProgram.admission`, `release_to_fit`, `backfill_fits`). The catalog is the logical
view of the checkpoints the Program holds (`catalog.py`). Resource transitions run as
transactions (`transactions.py`); `adopt` takes each one's result into the lanes and the
catalog, and `transactions` keeps their record.
"""

from __future__ import annotations

import enum

from ninfer_jax.engine.catalog import CatalogEntry, CheckpointCatalog
from ninfer_jax.engine.events import InvariantError
from ninfer_jax.engine.transactions import (
    ResourceResult,
    RunningTransaction,
    TransactionLog,
    Transition,
)


class LaneState(enum.Enum):
    FREE = "free"
    MATERIALIZING = "materializing"
    ACTIVE = "active"
    TERMINAL_PENDING = "terminal_pending"


_NEXT = {
    LaneState.FREE: {LaneState.MATERIALIZING},
    LaneState.MATERIALIZING: {LaneState.ACTIVE, LaneState.FREE},
    LaneState.ACTIVE: {LaneState.TERMINAL_PENDING},
    LaneState.TERMINAL_PENDING: {LaneState.FREE},
}


class ResourceManager:
    def __init__(self, num_lanes: int):
        self.lanes = [LaneState.FREE] * num_lanes
        self.owner: list[int | None] = [None] * num_lanes
        self.catalog = CheckpointCatalog()
        self.transactions = TransactionLog()

    def begin(self, transition: Transition, request_id: int | None = None
              ) -> RunningTransaction:
        return self.transactions.begin(transition, request_id)

    def adopt(self, result: ResourceResult, lane: int | None = None) -> CatalogEntry | None:
        """Takes a transaction's result (DESIGN §4: the Program's work is done, this is the
        logical view following it): a materialization's lane goes Active (committed) or Free
        (aborted), a release's Free; a captured or placed checkpoint enters the catalog (the
        entry is returned), a deleted one leaves it. An aborted transaction changed nothing
        else."""
        self.transactions.ended(result)
        kind = result.transition
        if kind is Transition.MATERIALIZE:
            self.move(lane, LaneState.ACTIVE if result.committed else LaneState.FREE,
                      result.request_id)
        elif not result.committed:
            return None
        elif kind is Transition.RELEASE:
            self.move(lane, LaneState.FREE, result.request_id)
        elif kind in (Transition.CAPTURE, Transition.PLACE):
            return self.catalog.add(result.checkpoint, result.tokens, result.scope)
        elif kind is Transition.DELETE:
            entry = self.catalog.get(result.tokens, result.scope)
            if entry is None or entry.ckpt != result.checkpoint:
                raise InvariantError(f"deleted {result.checkpoint} is not in the catalog")
            self.catalog.remove(entry, result.evicted)
        return None

    def free_lane(self) -> int | None:
        return next((i for i, s in enumerate(self.lanes) if s is LaneState.FREE), None)

    def move(self, lane: int, new: LaneState, request_id: int) -> None:
        if new not in _NEXT[self.lanes[lane]]:
            raise InvariantError(f"lane {lane}: illegal {self.lanes[lane].value} -> {new.value}")
        if self.lanes[lane] is not LaneState.FREE and self.owner[lane] != request_id:
            raise InvariantError(f"lane {lane} belongs to {self.owner[lane]}, not {request_id}")
        self.lanes[lane] = new
        self.owner[lane] = None if new is LaneState.FREE else request_id

    def num_free(self) -> int:
        return sum(s is LaneState.FREE for s in self.lanes)

    def clear(self) -> None:
        """Engine failure cleanup (DESIGN §8): every lane free; transactions still running
        are aborted (the Program's side was ended first)."""
        for txn in list(self.transactions.running.values()):
            txn.reload = None  # revoked by the Engine's cleanup
            result = txn.result or txn.abort("the Engine failed or closed")
            self.transactions.ended(result)  # a committed one's sequence was released
        self.lanes = [LaneState.FREE] * len(self.lanes)
        self.owner = [None] * len(self.lanes)
