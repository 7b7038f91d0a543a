"""The registry of eviction disciplines by name, and the built-in ones: "lru", "clock", "fifo".

Each keeps only an order over committed slots; pins are honoured by skipping pinned slots.
LRU evicts the least recently admitted-or-touched slot; FIFO the oldest admitted (touch does not
reorder); Clock approximates LRU with one reference bit per slot and a sweeping hand.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from ninfer_jax.store.errors import InvalidParam
from ninfer_jax.store.policy import ReplacementPolicy

_POLICIES: dict[str, type[ReplacementPolicy]] = {}


def register_policy(name: str) -> Callable[[type[ReplacementPolicy]], type[ReplacementPolicy]]:
    """Class decorator adding a policy to the registry under `name`."""

    def register(cls: type[ReplacementPolicy]) -> type[ReplacementPolicy]:
        if name in _POLICIES:
            raise InvalidParam(f"replacement policy {name!r} is already registered")
        _POLICIES[name] = cls
        return cls

    return register


def known_policies() -> list[str]:
    return sorted(_POLICIES)


def create_policy(name: str, capacity: int) -> ReplacementPolicy:
    """A set-up policy instance by registered name; an unknown name lists the known ones."""
    if name not in _POLICIES:
        raise InvalidParam(f"unknown replacement policy {name!r}; known: {known_policies()}")
    policy = _POLICIES[name]()
    policy.setup(capacity)
    return policy


@register_policy("lru")
class LruPolicy(ReplacementPolicy):
    def on_setup(self, capacity: int) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def on_slot_admitted(self, slot: int) -> None:
        self._order[slot] = None
        self._order.move_to_end(slot)

    def on_slot_touched(self, slot: int) -> None:
        self._order.move_to_end(slot)

    def on_slot_released(self, slot: int) -> None:
        del self._order[slot]

    def select_victim_slot(self) -> int | None:
        for slot in self._order:
            if self.pin_count(slot) == 0:
                return slot
        return None


@register_policy("fifo")
class FifoPolicy(LruPolicy):
    def on_slot_touched(self, slot: int) -> None:
        del slot  # admission order only


@register_policy("clock")
class ClockPolicy(ReplacementPolicy):
    def on_setup(self, capacity: int) -> None:
        self._in_ring = [False] * capacity
        self._referenced = [False] * capacity
        self._hand = 0

    def on_slot_admitted(self, slot: int) -> None:
        self._in_ring[slot] = True
        self._referenced[slot] = False

    def on_slot_touched(self, slot: int) -> None:
        self._referenced[slot] = True

    def on_slot_released(self, slot: int) -> None:
        self._in_ring[slot] = False
        self._referenced[slot] = False

    def select_victim_slot(self) -> int | None:
        # Two sweeps suffice: the first clears every reference bit it passes.
        for _ in range(2 * self.capacity):
            slot = self._hand
            self._hand = (self._hand + 1) % self.capacity
            if not self._in_ring[slot] or self.pin_count(slot):
                continue
            if self._referenced[slot]:
                self._referenced[slot] = False
                continue
            return slot
        return None
