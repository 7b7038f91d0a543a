"""Scheduler (DESIGN §5): the FIFO of waiting requests and the choice of the next model unit.

Owns order: which single waiting request may try admission (the FIFO head), the staged-prefill
gate (at most one request materializing or prefilling), and whether the next unit is a forced
control step, a prefill chunk or a compact decode round of exactly the decode-ready rows. Forced
control goes first (a request waits for it to rejoin decode; each is one short step). Decode is
never starved: a prefill chunk and a decode round alternate while both have work. It never picks
pages or lanes.
"""

from __future__ import annotations

import collections
import dataclasses

from ninfer_jax.engine.request import RequestRecord, RequestState


@dataclasses.dataclass(frozen=True)
class PrefillUnit:
    record: RequestRecord


@dataclasses.dataclass(frozen=True)
class DecodeUnit:
    records: tuple[RequestRecord, ...]


@dataclasses.dataclass(frozen=True)
class ControlUnit:
    record: RequestRecord  # ControlReady: commit its forced tokens (record.control)


class Scheduler:
    def __init__(self) -> None:
        self.waiting: collections.deque[RequestRecord] = collections.deque()
        self._last_was_prefill = False
        # Backfill (DESIGN §5): the blocked head, the incumbents it waits for, and the later
        # requests admitted ahead of it while it waits.
        self.protected: RequestRecord | None = None
        self.donors: set[int] = set()
        self.borrowers: set[int] = set()

    def enqueue(self, record: RequestRecord) -> None:
        self.waiting.append(record)

    def head(self) -> RequestRecord | None:
        return self.waiting[0] if self.waiting else None

    def remove(self, record: RequestRecord) -> None:
        self.waiting.remove(record)

    def protect(self, head: RequestRecord, donors: set[int]) -> None:
        if self.protected is not head:
            self.protected, self.donors, self.borrowers = head, donors, set()

    def unprotect(self) -> None:
        self.protected, self.donors, self.borrowers = None, set(), set()

    def backfill_candidates(self, window: int) -> list[RequestRecord]:
        return [r for r in list(self.waiting)[1 : 1 + window]
                if not r.cancel_requested.is_set()]

    @staticmethod
    def prefill_gate_open(active: list[RequestRecord]) -> bool:
        """One staged prefill at a time: no request is materializing or prefilling."""
        return not any(r.state in (RequestState.MATERIALIZING, RequestState.PREFILL)
                       for r in active)

    def next_unit(self, active: list[RequestRecord]
                  ) -> ControlUnit | PrefillUnit | DecodeUnit | None:
        control = next((r for r in active if r.state is RequestState.CONTROL_READY), None)
        if control is not None:
            return ControlUnit(control)
        prefilling = [r for r in active if r.state is RequestState.PREFILL]
        ready = tuple(r for r in active if r.state is RequestState.DECODE_READY)
        if prefilling and (not ready or not self._last_was_prefill):
            self._last_was_prefill = True
            return PrefillUnit(prefilling[0])
        self._last_was_prefill = False
        return DecodeUnit(ready) if ready else None
