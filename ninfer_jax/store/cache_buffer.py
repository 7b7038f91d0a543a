"""CacheBuffer: the TokenAddressed protocol mapped onto a ReplacementPolicy's slots (seed §8.2).

Owns the block -> slot mapping, visibility, shared reservations, pins and TTL. Does not own bytes
(the store keeps slot memory indexed by slot) nor job bookkeeping.

- reserve(ids, ttl_ms) is two-phase: known blocks are settled first (a pending block gains a
  reference, a committed block is re-admitted: it keeps its slot, policy-pinned until concluded),
  then newcomers are placed (sweep expired under pressure, then acquire; evictees are reported).
  A failure replays the journal in reverse: victims come back in place with their deadlines (G2,
  G3, G8). `partial=True` instead keeps what was placed and reports the newcomers that found no
  slot as `unplaced` (the leading newcomers in batch order win): for a store with a tier below
  that takes the rest.
- commit(ids, success): one reference per call; the last one decides, any success commits (G7).
  A re-admitted block that expired meanwhile is revived by a successful conclusion (G9).
- TTL: deadlines on an injectable monotonic clock; expiry is lazy at lookup/touch/pin and swept
  under pressure; an expired block is invisible at once but its slot is freed only when unpinned.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from ninfer_jax.store.errors import InvalidParam, NoSpace, NotFound
from ninfer_jax.store.expiry import ExpiryQueue
from ninfer_jax.store.policies import create_policy
from ninfer_jax.store.policy import ReplacementPolicy
from ninfer_jax.store.types import BlockId, require_unique


@dataclasses.dataclass
class _Entry:
    slot: int
    committed: bool
    deadline: float | None = None  # seconds on the buffer's clock; committed blocks only
    pins: int = 0  # caller pins (committed blocks only)
    refs: int = 0  # outstanding allocs: sharers of a reservation, or re-admissions
    any_success: bool = False
    ttl_ms: int | None = None  # TTL the pending decision applies (last writer wins)


@dataclasses.dataclass(frozen=True)
class Reservation:
    """Slots for a reserved batch, in batch order, and the blocks evicted to make room.

    `slots[i]` is None exactly when `ids[i]` is in `unplaced` (a partial reservation only).
    """

    slots: tuple[int | None, ...]
    evicted: tuple[BlockId, ...]
    unplaced: tuple[BlockId, ...] = ()


class CacheBuffer:
    def __init__(
        self, capacity: int, policy: str | ReplacementPolicy = "lru",
        clock: Callable[[], float] = time.monotonic,
    ):
        if isinstance(policy, str):
            policy = create_policy(policy, capacity)
        self._policy = policy
        self._clock = clock
        self._entries: dict[BlockId, _Entry] = {}
        self._slot_owner: dict[int, BlockId] = {}
        self._expiry = ExpiryQueue()
        self._num_deadlines = 0
        self.evictions = 0  # committed blocks evicted for newcomers (rolled-back ones excluded)

    @property
    def capacity(self) -> int:
        return self._policy.capacity

    # -- probes ---------------------------------------------------------------------------------
    def lookup(self, ids: Sequence[BlockId]) -> list[bool]:
        now = self._clock()
        return [self._visible(block_id, now) is not None for block_id in ids]

    def slot_of(self, block_id: BlockId) -> int | None:
        """The slot of a visible (committed, unexpired) block."""
        entry = self._visible(block_id, self._clock())
        return None if entry is None else entry.slot

    def is_pending(self, block_id: BlockId) -> bool:
        """Reserved and not yet committed: being written here, invisible to lookup."""
        entry = self._entries.get(block_id)
        return entry is not None and not entry.committed

    def is_guarded(self, block_id: BlockId) -> bool:
        """Pinned (by a caller or a re-admission) or reserved: no reservation can evict it."""
        entry = self._entries.get(block_id)
        return entry is not None and not self._policy.is_evictable(entry.slot)

    def num_placeable(self) -> int:
        """How many newcomers a reservation could place now: free or evictable slots."""
        return self._policy.num_free + self._policy.num_evictable

    def touch(self, ids: Sequence[BlockId], ttl_ms: int | None = None) -> None:
        """Refreshes heat of visible blocks; a TTL extends (never shortens) their deadline."""
        now = self._clock()
        for block_id in ids:
            entry = self._visible(block_id, now)
            if entry is None:
                continue
            self._policy.touch_slot(entry.slot)
            if ttl_ms is not None and entry.deadline is not None:
                self._set_deadline(block_id, entry, max(entry.deadline, now + ttl_ms / 1000))

    # -- pins -----------------------------------------------------------------------------------
    def pin(self, ids: Sequence[BlockId]) -> list[int]:
        """Pins every block or none: a missing, reserved or expired id is NotFound (G3)."""
        require_unique(ids, "pin")
        now = self._clock()
        entries = []
        for block_id in ids:
            entry = self._visible(block_id, now)
            if entry is None:
                raise NotFound(f"pin: block {block_id.hex()} is not committed here")
            entries.append(entry)
        for entry in entries:
            entry.pins += 1
            self._policy.pin_slot(entry.slot)
            self._policy.touch_slot(entry.slot)
        return [entry.slot for entry in entries]

    def unpin(self, ids: Sequence[BlockId]) -> None:
        """Drops one pin per id; ids that hold no pin are ignored (idempotent)."""
        now = self._clock()
        for block_id in ids:
            entry = self._entries.get(block_id)
            if entry is None or entry.pins == 0:
                continue
            entry.pins -= 1
            self._policy.unpin_slot(entry.slot)
            if self._expired(entry, now) and self._policy.pin_count(entry.slot) == 0:
                self._remove(block_id, entry)

    def pin_count(self, block_id: BlockId) -> int:
        entry = self._entries.get(block_id)
        return 0 if entry is None else entry.pins

    # -- admission ------------------------------------------------------------------------------
    def reserve(self, ids: Sequence[BlockId], ttl_ms: int | None = None,
                partial: bool = False) -> Reservation:
        require_unique(ids, "reserve")
        now = self._clock()
        journal: list[tuple] = []
        slots: list[int | None] = [None] * len(ids)
        evicted: list[BlockId] = []
        unplaced: list[BlockId] = []
        try:
            newcomers = []
            for i, block_id in enumerate(ids):
                entry = self._entries.get(block_id)
                if entry is not None and self._expired(entry, now) \
                        and self._policy.pin_count(entry.slot) == 0:
                    self._remove(block_id, entry)
                    entry = None
                if entry is None:
                    newcomers.append(i)
                    continue
                journal.append(("settle", block_id, entry.ttl_ms))
                if entry.committed and entry.refs == 0:
                    self._policy.pin_slot(entry.slot)  # guards the in-flight rewrite
                    entry.any_success = False
                entry.refs += 1
                entry.ttl_ms = ttl_ms
                slots[i] = entry.slot
            for n, i in enumerate(newcomers):
                slots[i] = self._place(ids[i], ttl_ms, now, journal, evicted)
                if slots[i] is None:
                    if not partial:
                        raise NoSpace(
                            f"reserve: a batch of {len(ids)} block(s) ({len(newcomers)} new) "
                            f"does not fit: no slot for block {ids[i].hex()}; capacity is "
                            f"{self.capacity}, {n} slot(s) went to the batch's earlier newcomers "
                            f"and the other {self.capacity - n} slots are pinned or reserved")
                    unplaced = [ids[j] for j in newcomers[n:]]
                    break
        except NoSpace:
            self._rollback(journal)
            raise
        self.evictions += len(evicted)
        return Reservation(tuple(slots), tuple(evicted), tuple(unplaced))

    def commit(self, ids: Sequence[BlockId], success: bool) -> None:
        """Concludes one outstanding alloc per id; every id is checked before anything changes."""
        require_unique(ids, "commit")
        for block_id in ids:
            entry = self._entries.get(block_id)
            if entry is None or entry.refs == 0:
                raise InvalidParam(f"commit: block {block_id.hex()} has no outstanding alloc")
        now = self._clock()
        for block_id in ids:
            entry = self._entries[block_id]
            entry.refs -= 1
            entry.any_success |= bool(success)
            if entry.refs:
                continue
            decided, entry.any_success = entry.any_success, False
            if not entry.committed:
                if decided:
                    self._policy.commit_slot(entry.slot)
                    entry.committed = True
                    self._set_deadline(block_id, entry, self._deadline(entry.ttl_ms, now))
                else:
                    self._policy.abort_slot(entry.slot)
                    self._forget(block_id, entry)
                continue
            self._policy.unpin_slot(entry.slot)
            if decided and self._expired(entry, now):
                self._expiry.deferred.discard(block_id)
                self._set_deadline(block_id, entry, self._deadline(entry.ttl_ms, now))
                self._policy.touch_slot(entry.slot)
            elif self._expired(entry, now) and self._policy.pin_count(entry.slot) == 0:
                self._remove(block_id, entry)

    def alloc_refs(self, block_id: BlockId) -> int:
        """How many allocs of this block still await their commit."""
        entry = self._entries.get(block_id)
        return 0 if entry is None else entry.refs

    def reserved_slot(self, block_id: BlockId) -> int | None:
        """The slot of a block with an outstanding alloc (pending or re-admitted)."""
        entry = self._entries.get(block_id)
        return None if entry is None or entry.refs == 0 else entry.slot

    def sweep_expired(self) -> list[BlockId]:
        """Frees every expired, unpinned block; pinned ones stay deferred. Returns freed ids."""
        now = self._clock()
        freed = []
        for block_id in list(self._expiry.deferred):
            entry = self._entries.get(block_id)
            if entry is None or not self._expired(entry, now):
                self._expiry.deferred.discard(block_id)
            elif self._policy.pin_count(entry.slot) == 0:
                self._remove(block_id, entry)
                freed.append(block_id)
        for block_id in self._expiry.pop_due(now, self._deadline_of):
            entry = self._entries[block_id]
            if self._policy.pin_count(entry.slot) == 0:
                self._remove(block_id, entry)
                freed.append(block_id)
            else:
                self._expiry.deferred.add(block_id)
        return freed

    # -- introspection for stores and tests -----------------------------------------------------
    def committed_ids(self) -> set[BlockId]:
        """Visible blocks (committed and unexpired), without side effects."""
        now = self._clock()
        return {b for b, e in self._entries.items() if e.committed and not self._expired(e, now)}

    def pending_ids(self) -> set[BlockId]:
        return {b for b, e in self._entries.items() if not e.committed}

    def num_free_slots(self) -> int:
        return self._policy.num_free

    def num_heap_items(self) -> int:
        return len(self._expiry)

    def num_pins(self) -> int:
        """Caller pins held, summed over blocks (re-admission pins are counted as allocs)."""
        return sum(e.pins for e in self._entries.values())

    def num_allocs(self) -> int:
        """Allocs awaiting their commit, summed over blocks (shared reservations count each)."""
        return sum(e.refs for e in self._entries.values())

    # -- internals ------------------------------------------------------------------------------
    def _place(self, block_id: BlockId, ttl_ms: int | None, now: float, journal: list,
               evicted: list[BlockId]) -> int | None:
        """The newcomer's slot, evicting a victim if needed; None when every slot is guarded."""
        if self._policy.num_free == 0:
            self.sweep_expired()
        acquired = self._policy.acquire_slot()
        if acquired is None:
            return None
        victim = None
        if acquired.evicted:
            victim_id = self._slot_owner[acquired.slot]
            victim = (victim_id, self._entries[victim_id])
            self._forget(victim_id, victim[1])
            evicted.append(victim_id)
        self._entries[block_id] = _Entry(acquired.slot, committed=False, refs=1, ttl_ms=ttl_ms)
        self._slot_owner[acquired.slot] = block_id
        journal.append(("place", block_id, acquired.slot, victim))
        return acquired.slot

    def _rollback(self, journal: list) -> None:
        for record in reversed(journal):
            if record[0] == "settle":
                _, block_id, old_ttl = record
                entry = self._entries[block_id]
                entry.refs -= 1
                entry.ttl_ms = old_ttl
                if entry.committed and entry.refs == 0:
                    self._policy.unpin_slot(entry.slot)
                continue
            _, block_id, slot, victim = record
            del self._entries[block_id]
            del self._slot_owner[slot]
            if victim is None:
                self._policy.abort_slot(slot)
                continue
            victim_id, victim_entry = victim
            self._entries[victim_id] = victim_entry
            self._slot_owner[slot] = victim_id
            self._policy.commit_slot(slot)
            if victim_entry.deadline is not None:
                self._num_deadlines += 1
                self._expiry.push(victim_id, victim_entry.deadline)

    def _visible(self, block_id: BlockId, now: float) -> _Entry | None:
        entry = self._entries.get(block_id)
        if entry is None or not entry.committed:
            return None
        if self._expired(entry, now):
            if self._policy.pin_count(entry.slot) == 0:
                self._remove(block_id, entry)
            else:
                self._expiry.deferred.add(block_id)
            return None
        return entry

    @staticmethod
    def _expired(entry: _Entry, now: float) -> bool:
        return entry.committed and entry.deadline is not None and entry.deadline <= now

    @staticmethod
    def _deadline(ttl_ms: int | None, now: float) -> float | None:
        return None if ttl_ms is None else now + ttl_ms / 1000

    def _deadline_of(self, block_id: BlockId) -> float | None:
        entry = self._entries.get(block_id)
        return None if entry is None or not entry.committed else entry.deadline

    def _set_deadline(self, block_id: BlockId, entry: _Entry, deadline: float | None) -> None:
        self._num_deadlines += (deadline is not None) - (entry.deadline is not None)
        entry.deadline = deadline
        if deadline is not None:
            self._expiry.push(block_id, deadline)
            self._expiry.maybe_compact(
                ((b, e.deadline) for b, e in self._entries.items()
                 if e.committed and e.deadline is not None),
                self._num_deadlines,
            )

    def _remove(self, block_id: BlockId, entry: _Entry) -> None:
        self._policy.release_slot(entry.slot)
        self._forget(block_id, entry)

    def _forget(self, block_id: BlockId, entry: _Entry) -> None:
        del self._entries[block_id]
        del self._slot_owner[entry.slot]
        self._expiry.deferred.discard(block_id)
        if entry.committed and entry.deadline is not None:
            self._num_deadlines -= 1
