"""The slot engine: a fixed pool of slots whose eviction discipline is pluggable (seed §8.1).

`ReplacementPolicy` is a template: the base owns the pool (an O(1) intrusive free list, pin counts,
reserved/committed flags) and the slot lifecycle

    FREE --acquire--> RESERVED --commit_slot--> COMMITTED --release_slot--> FREE
    RESERVED --abort_slot--> FREE        COMMITTED --(evicted by acquire)--> RESERVED

A subclass contributes only the discipline: `on_setup`, `on_slot_admitted`, `on_slot_touched`,
`on_slot_released`, `select_victim_slot`. An evicted slot goes straight from committed to reserved
for the newcomer and is reported, so the caller invalidates the victim's mapping first.
`num_free` and `num_evictable` (committed, unpinned) are kept current in O(1), so a caller can ask
how many newcomers would find a slot without scanning the pool.
Block ids, visibility and TTL belong to CacheBuffer, not here; the registry of policies by
name, and the built-in ones, live in `policies.py`.
"""

from __future__ import annotations

import abc
import dataclasses
import enum

from ninfer_jax.store.errors import InvalidParam


class SlotState(enum.Enum):
    FREE = "free"
    RESERVED = "reserved"
    COMMITTED = "committed"


@dataclasses.dataclass(frozen=True)
class AcquiredSlot:
    """A slot now reserved for a newcomer; `evicted` says a committed occupant was displaced."""

    slot: int
    evicted: bool


class ReplacementPolicy(abc.ABC):
    """Fixed-capacity slot pool; subclasses rank victims among committed, unpinned slots."""

    def setup(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise InvalidParam(f"replacement policy: capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self._state = [SlotState.FREE] * capacity
        self._pins = [0] * capacity
        # Intrusive free list: each free slot names the next free one; the tail points at itself.
        self._next_free: list[int | None] = [i + 1 for i in range(capacity)]
        self._next_free[-1] = capacity - 1
        self._free_head: int | None = 0
        self.num_free = capacity
        self.num_evictable = 0
        self.on_setup(capacity)

    # -- the discipline -------------------------------------------------------------------------
    @abc.abstractmethod
    def on_setup(self, capacity: int) -> None: ...

    @abc.abstractmethod
    def on_slot_admitted(self, slot: int) -> None: ...

    @abc.abstractmethod
    def on_slot_touched(self, slot: int) -> None: ...

    @abc.abstractmethod
    def on_slot_released(self, slot: int) -> None: ...

    @abc.abstractmethod
    def select_victim_slot(self) -> int | None:
        """A committed slot with no pins, or None when every committed slot is pinned."""

    # -- the pool -------------------------------------------------------------------------------
    def state(self, slot: int) -> SlotState:
        return self._state[slot]

    def pin_count(self, slot: int) -> int:
        return self._pins[slot]

    def is_evictable(self, slot: int) -> bool:
        return self._state[slot] is SlotState.COMMITTED and self._pins[slot] == 0

    def acquire_slot(self) -> AcquiredSlot | None:
        """A free slot, else a victim chosen by the discipline, else None (pool exhausted)."""
        if self._free_head is not None:
            slot = self._free_head
            nxt = self._next_free[slot]
            self._free_head = None if nxt == slot else nxt
            self._next_free[slot] = None
            self.num_free -= 1
            self._state[slot] = SlotState.RESERVED
            return AcquiredSlot(slot, evicted=False)
        victim = self.select_victim_slot()
        if victim is None:
            return None
        if not self.is_evictable(victim):
            raise AssertionError(f"{type(self).__name__} chose slot {victim}, which is not "
                                 "committed and unpinned")
        self.on_slot_released(victim)
        self._state[victim] = SlotState.RESERVED
        self.num_evictable -= 1
        return AcquiredSlot(victim, evicted=True)

    def commit_slot(self, slot: int) -> None:
        self._expect(slot, SlotState.RESERVED)
        self._state[slot] = SlotState.COMMITTED
        self.num_evictable += int(self._pins[slot] == 0)
        self.on_slot_admitted(slot)

    def abort_slot(self, slot: int) -> None:
        self._expect(slot, SlotState.RESERVED)
        self._free(slot)

    def release_slot(self, slot: int) -> None:
        self._expect(slot, SlotState.COMMITTED)
        if self._pins[slot]:
            raise AssertionError(f"slot {slot} released while pinned {self._pins[slot]} times")
        self.on_slot_released(slot)
        self.num_evictable -= 1
        self._free(slot)

    def touch_slot(self, slot: int) -> None:
        self._expect(slot, SlotState.COMMITTED)
        self.on_slot_touched(slot)

    def pin_slot(self, slot: int) -> None:
        self.num_evictable -= int(self.is_evictable(slot))
        self._pins[slot] += 1

    def unpin_slot(self, slot: int) -> None:
        if self._pins[slot] == 0:
            raise AssertionError(f"slot {slot} unpinned more often than pinned")
        self._pins[slot] -= 1
        self.num_evictable += int(self.is_evictable(slot))

    def _free(self, slot: int) -> None:
        self._state[slot] = SlotState.FREE
        self._next_free[slot] = slot if self._free_head is None else self._free_head
        self._free_head = slot
        self.num_free += 1

    def _expect(self, slot: int, state: SlotState) -> None:
        if self._state[slot] is not state:
            raise AssertionError(f"slot {slot} is {self._state[slot].value}, expected {state.value}")
