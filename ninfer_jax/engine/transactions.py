"""Resource transitions as transactions (DESIGN §4, §10 "Plans"): a logical choice, a plan the
Program seals, a RunningTransaction, and its ResourceResult, which the ResourceManager adopts.

The transitions are the ones that change global resources or ownership: a waiting request's
materialization (possibly waiting on a context-store read first: a revocable claim), an active
sequence's checkpoint capture, the release of a finished request's sequence, and an inactive
checkpoint's placement (an image imported from the context store) or deletion. Each
transaction ends exactly once, committed or aborted, and its result says completely what it
left: the sequence or checkpoint it created or removed, the tokens a checkpoint holds and its
cache scope, the prompt positions a sequence starts with, and for an abort why (an aborted
transaction leaves no claim: a revoked read imported nothing, a sequence was never made).
The ResourceManager adopts each result: lanes, the catalog, and the counts in
`TransactionStats` (started = committed + aborted + running, and nothing is running once the
Engine is idle).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from typing import TYPE_CHECKING, Any

from ninfer_jax.engine.events import InvariantError

if TYPE_CHECKING:
    from ninfer_jax.engine.tiers import Reload
    from ninfer_jax.program.checkpoints import CheckpointId
    from ninfer_jax.program.pending import SequenceHandle


class Transition(enum.Enum):
    MATERIALIZE = "materialize"  # a waiting request becomes a Program sequence
    CAPTURE = "capture"  # an active sequence's frontier becomes a checkpoint
    RELEASE = "release"  # a finished request's sequence is given back
    PLACE = "place"  # a checkpoint image from the context store is imported
    DELETE = "delete"  # an inactive checkpoint is released


@dataclasses.dataclass(frozen=True)
class ResourceResult:
    """The complete end state of one transaction."""

    txn_id: int
    transition: Transition
    committed: bool
    request_id: int | None = None
    sequence: SequenceHandle | None = None  # MATERIALIZE, RELEASE: made or given back
    checkpoint: CheckpointId | None = None  # CAPTURE, PLACE: made; DELETE: released
    tokens: tuple[int, ...] = ()  # CAPTURE, PLACE: the checkpoint's tokens
    scope: str | None = None  # CAPTURE, PLACE: its cache scope
    cached_tokens: int = 0  # MATERIALIZE: prompt positions restored from a checkpoint
    evicted: bool = False  # DELETE: released to make room (not cleared or closed)
    reason: str | None = None  # an abort: why


@dataclasses.dataclass(eq=False)
class RunningTransaction:
    """A started transition; `commit` or `abort` ends it, once. A MATERIALIZE may wait on a
    context-store read (`reload`) over several Engine iterations; a cancel in that window
    aborts it."""

    txn_id: int
    transition: Transition
    request_id: int | None
    reload: Reload | None = None  # a context-store read in flight (MATERIALIZE only)
    result: ResourceResult | None = None

    def commit(self, **end: Any) -> ResourceResult:
        return self._end(True, end)

    def abort(self, reason: str) -> ResourceResult:
        if self.reload is not None:
            raise InvariantError(f"transaction {self.txn_id}: aborted with its read in flight")
        return self._end(False, {"reason": reason})

    def _end(self, committed: bool, end: dict[str, Any]) -> ResourceResult:
        if self.result is not None:
            raise InvariantError(f"transaction {self.txn_id} ({self.transition.value}) ended "
                                 f"twice")
        self.result = ResourceResult(self.txn_id, self.transition, committed, self.request_id,
                                     **end)
        return self.result


@dataclasses.dataclass(frozen=True)
class TransactionStats:
    started: int
    committed: int
    aborted: int
    running: int
    by_transition: dict[str, tuple[int, int]]  # transition -> (committed, aborted)


class TransactionLog:
    """The ResourceManager's record of transactions: the running ones and the counts."""

    def __init__(self):
        self._ids = itertools.count()
        self.running: dict[int, RunningTransaction] = {}
        self._ended: dict[tuple[Transition, bool], int] = {}
        self._stats: TransactionStats | None = None  # until a transaction begins or ends

    def begin(self, transition: Transition, request_id: int | None = None) -> RunningTransaction:
        txn = RunningTransaction(next(self._ids), transition, request_id)
        self.running[txn.txn_id] = txn
        self._stats = None
        return txn

    def ended(self, result: ResourceResult) -> None:
        txn = self.running.pop(result.txn_id, None)
        if txn is None or txn.result is not result:
            raise InvariantError(f"result of transaction {result.txn_id} adopted twice or "
                                 f"never started")
        key = (result.transition, result.committed)
        self._ended[key] = self._ended.get(key, 0) + 1
        self._stats = None

    def stats(self) -> TransactionStats:
        if self._stats is None:
            committed = sum(n for (_, ok), n in self._ended.items() if ok)
            aborted = sum(n for (_, ok), n in self._ended.items() if not ok)
            by = {t.value: (self._ended.get((t, True), 0), self._ended.get((t, False), 0))
                  for t in Transition}
            self._stats = TransactionStats(committed + aborted + len(self.running), committed,
                                           aborted, len(self.running), by)
        return self._stats
