"""ResourceManager (DESIGN §2, §3, §7): logical lanes, the checkpoint catalog (its prefix
index and SessionIndex), and their adoption of Program results.

Owns lanes: `Free -> Materializing -> Active -> TerminalPending -> Free`. A lane is a logical
claim, not a slot, page or batch row; the Program owns those and is asked, never mirrored: it
alone answers whether a sequence fits, which checkpoints to release for it and the backfill
proof (`HostProgram.admission`, `release_to_fit`, `backfill_fits`). The catalog is the logical
view of the checkpoints the Program holds (`catalog.py`).
"""

from __future__ import annotations

import enum

from ninfer_jax.engine.catalog import CheckpointCatalog
from ninfer_jax.engine.request import InvariantError


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
        self.lanes = [LaneState.FREE] * len(self.lanes)
        self.owner = [None] * len(self.lanes)
