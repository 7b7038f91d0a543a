"""Host-side ownership of the physical pools: KV pages (refcounted, reservable) and state slots.

Owns which page and slot belongs to whom. A reservation is a promise of future pages: admitting a
sequence reserves its complete growth (prompt + max new tokens) so it can always finish, and its
pages are then drawn from that reservation as it grows. Pages carry refcounts so that later
checkpoints can share them. Pure Python; the device arrays live in `pools.py`.
"""

from __future__ import annotations

from ninfer_jax.program.errors import ResourceError


class PageAllocator:
    """Refcounted pages with reservations. Page ids are 0..num_pages-1."""

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages
        self._reserved = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_reserved(self) -> int:
        """Free pages promised to admitted sequences."""
        return self._reserved

    @property
    def num_available(self) -> int:
        """Free pages nobody has been promised."""
        return len(self._free) - self._reserved

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def reserve(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"cannot reserve {n} pages")
        if n > self.num_available:
            raise ResourceError(
                f"cannot reserve {n} pages: {self.num_available} available "
                f"({self.num_free} free, {self._reserved} already reserved)"
            )
        self._reserved += n

    def unreserve(self, n: int) -> None:
        if not 0 <= n <= self._reserved:
            raise ResourceError(f"cannot unreserve {n} pages: only {self._reserved} reserved")
        self._reserved -= n

    def allocate_reserved(self) -> int:
        """Takes one page out of the reservation (refcount 1)."""
        if self._reserved == 0:
            raise ResourceError("allocate_reserved with no reservation left")
        self._reserved -= 1
        page = self._free.pop()
        self._refs[page] = 1
        return page

    def incref(self, page: int) -> None:
        if self._refs[page] <= 0:
            raise ResourceError(f"incref of free page {page}")
        self._refs[page] += 1

    def decref(self, page: int) -> None:
        if self._refs[page] <= 0:
            raise ResourceError(f"decref of free page {page}")
        self._refs[page] -= 1
        if self._refs[page] == 0:
            self._free.append(page)


class SlotAllocator:
    """GDN state slots (and their per-slot sampling state), ids 0..num_slots-1."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise ResourceError(f"all {self.num_slots} state slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._used:
            raise ResourceError(f"release of slot {slot}, which is not in use")
        self._used.remove(slot)
        self._free.append(slot)
