"""Admission: which waiting request starts next, and how its sequence comes to be.

Worker-owned (DESIGN §4, §5). Admits the FIFO head (evicting inactive checkpoints when that
makes it fit) or, while the head waits for incumbents, one later request the backfill proof
allows; claims a lane and moves the request to Materializing. Materialization asks the Program
for a sealed plan from the longest device checkpoint (`HostProgram.admission`) and runs the
MATERIALIZE transaction, which may first wait on a context-store read (`Retention`). Owns the
adoption of a committed materialization, its abort on a cancel or deadline, and the RELEASE
transaction of a finished request's sequence. Admission never computes the Program's
arithmetic: it asks and adopts the answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ninfer_jax.engine.events import InvariantError
from ninfer_jax.engine.request import RequestRecord, RequestState
from ninfer_jax.engine.resources import LaneState, ResourceManager
from ninfer_jax.engine.retention import Retention
from ninfer_jax.engine.scheduler import Scheduler
from ninfer_jax.engine.transactions import Transition
from ninfer_jax.frontend.output_session import ending_ids
from ninfer_jax.program.host import HostProgram
from ninfer_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ninfer_jax.frontend.loading import Frontend


class Admission:
    def __init__(self, program: HostProgram, frontend: Frontend, scheduler: Scheduler,
                 resources: ResourceManager, retention: Retention, backfill_window: int):
        self.program, self.frontend, self.scheduler = program, frontend, scheduler
        self.resources, self.retention = resources, retention
        self.backfill_window = backfill_window
        self.backfilled = 0  # requests admitted ahead of a blocked head by the backfill proof
        self._blocked_on: tuple | None = None  # admission facts of the last failed attempt

    def try_admit(self, active: list[RequestRecord]) -> bool:
        """Admits the FIFO head, evicting inactive checkpoints if it needs room; when the head is
        blocked by incumbents, lets one later request borrow if the backfill proof holds. An
        admitted request joins `active`."""
        head = self.scheduler.head()
        if head is None or not Scheduler.prefill_gate_open(active):
            return False
        if self._facts() == self._blocked_on:
            return False  # nothing that decides the outcome changed since it last failed
        admitted = self._admit(head, active, may_evict=True)
        if admitted:
            self.scheduler.unprotect()
        else:
            self.scheduler.protect(head, {r.request_id for r in active})
            for r in self.scheduler.backfill_candidates(self.backfill_window):
                if self._backfill_proven(head, r, active) and \
                        self._admit(r, active, may_evict=False):
                    self.scheduler.borrowers.add(r.request_id)
                    self.backfilled += 1
                    admitted = True
                    break
        # The facts after the attempt (it may have evicted or reloaded and still failed).
        self._blocked_on = None if admitted else self._facts()
        return admitted

    def filling(self) -> bool:
        """Whether requests wait that an admission may take now: a lane is free and the last
        attempt did not fail on the same facts (the batch fills one request an iteration)."""
        return bool(self.scheduler.waiting) and self.resources.num_free() > 0 and \
            self._blocked_on != self._facts()

    def _facts(self) -> tuple[int, int, int, int]:
        """What an admission attempt's outcome depends on (DESIGN §4): the Program's resources
        (its revision changes when capacity is claimed or released, a checkpoint captured,
        imported or released), the catalog's entries and bindings, the waiting requests (the
        head and the backfill candidates) and the free lanes."""
        return (self.program.resource_revision, self.retention.catalog.version,
                self.scheduler.version, self.resources.num_free())

    def _backfill_proven(self, head: RequestRecord, r: RequestRecord,
                         active: list[RequestRecord]) -> bool:
        """DESIGN §5: with `r` holding its full reservation, once the donors finish the head
        still enters from root with all inactive cache released."""
        if not any(x.request_id in self.scheduler.donors for x in active):
            return False  # nobody to wait for: the head goes next
        borrowers = [x for x in active if x.request_id in self.scheduler.borrowers]
        together = [head, r, *borrowers]
        return len(together) <= len(self.resources.lanes) and self.program.backfill_fits(
            [(x.prompt_tokens, x.sampling.max_new_tokens) for x in together])

    def _admit(self, r: RequestRecord, active: list[RequestRecord], may_evict: bool) -> bool:
        """Claims a lane for `r` and moves it to Materializing: with a context-store read
        started (a revocable claim: the sequence is materialized when the read ends), or with
        its sequence materialized now. False: it cannot start yet (nothing was taken)."""
        lane = self.resources.free_lane()
        if lane is None:
            return False
        reload = self.retention.start_reload(r, may_evict)
        if reload is not None:  # a revocable claim until the read ends
            r.txn = self.resources.begin(Transition.MATERIALIZE, r.request_id)
            r.txn.reload = reload
        elif not self.materialize(r, may_evict):
            return False
        self.scheduler.remove(r)
        self.resources.move(lane, LaneState.MATERIALIZING, r.request_id)
        r.lane = lane
        r.may_evict = may_evict
        r.move(RequestState.MATERIALIZING)
        active.append(r)
        return True

    def materialize(self, r: RequestRecord, may_evict: bool) -> bool:
        """Plans `r` from its longest device checkpoint (evicting inactive ones if that makes
        it fit) and materializes its sequence: its MATERIALIZE transaction (the one waiting on
        a read, or a new one) commits, and the result waits in `r.materialized` to be adopted.
        False if it cannot start now (no transaction is started for that)."""
        catalog = self.retention.catalog
        reuse = self.retention.reuse and r.reuse
        source = catalog.lookup(r.prompt.identity, r.session_key, r.cache_scope) \
            if reuse else None

        def ask(evictable=()):
            return self.program.admission(r.prompt_tokens, r.sampling.max_new_tokens,
                                          None if source is None else source.ckpt, evictable)

        victims = {v.ckpt: v for v in catalog.eviction_order(keep=source)} if may_evict else {}
        answer = ask(list(victims))
        if not answer.fits and answer.evict:
            # Inactive cache is what stands in the way: release what the Program named (least
            # recently used first), then the plan it seals again fits.
            for ckpt in answer.evict:
                self.retention.drop(victims[ckpt], evicted=True)
            answer = ask()
            if not answer.fits:
                raise InvariantError(f"request {r.request_id}: releasing the checkpoints the "
                                     "Program named did not make room")
        if not answer.fits:
            return False  # blocked by incumbents; they always finish (they hold reservations)
        sealed = answer.plan
        if r.txn is None:
            r.txn = self.resources.begin(Transition.MATERIALIZE, r.request_id)
        media = {"media": r.prompt.media} if r.prompt.media else {}
        seq = self.program.materialize(sealed, r.prompt.token_ids, r.sampling,
                                       self._stop_ids(r.sampling), **media)
        if reuse:
            catalog.record_use(source)
            # The publication slot (DESIGN §7): the slot its turn checkpoint will take, so its
            # end does not evict another checkpoint to keep its own. Taken from free slots only
            # (never by evicting); a request without one evicts at its end.
            self.program.reserve_publication(seq)
        r.materialized = r.txn.commit(sequence=seq, cached_tokens=sealed.cached_tokens)
        return True

    def _stop_ids(self, sampling: SamplingParams) -> tuple[int, ...]:
        """The ids the Program keeps from being sampled before `min_tokens`: every id that
        would end the output (none when min_tokens is 0)."""
        if not sampling.min_tokens:
            return ()
        return tuple(sorted(ending_ids(self.frontend.tokenizer, sampling.stop_token_ids,
                                       sampling.ignore_eos)))

    def adopt(self, r: RequestRecord) -> None:
        """Adopts a committed materialization (its lane goes Active): the Engine owns the
        sequence from here."""
        result, r.materialized, r.txn = r.materialized, None, None
        self.resources.adopt(result, r.lane)
        r.seq, r.cached_tokens = result.sequence, result.cached_tokens

    def abort(self, r: RequestRecord, reason: str) -> None:
        """A cancel or deadline while Materializing (DESIGN §3): a running transaction is
        aborted (a context-store read in flight is revoked: nothing was imported) and its lane
        freed; one committed but not yet adopted is adopted, then its sequence released."""
        if r.materialized is not None:
            self.adopt(r)
            self.resources.move(r.lane, LaneState.TERMINAL_PENDING, r.request_id)
            self.release(r)
            return
        self.retention.abort_reload(r)
        txn, r.txn = r.txn, None
        self.resources.adopt(txn.abort(reason), r.lane)

    def release(self, r: RequestRecord) -> None:
        """The RELEASE transaction of a terminal request's sequence; its lane goes Free."""
        txn = self.resources.begin(Transition.RELEASE, r.request_id)
        self.program.release(r.seq)
        self.resources.adopt(txn.commit(sequence=r.seq), r.lane)
        r.seq = None
