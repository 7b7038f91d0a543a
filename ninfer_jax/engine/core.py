"""EngineCore: the worker thread that alone drives records, Scheduler, ResourceManager and Program.

Owns the boundary order of DESIGN §4, the commit-then-publish order of §6 and the cancellation
and failure rules of §8. Other threads reach it only through `submit` (a queue), a request's
cancellation flag, and the events it publishes. Imports no jax: the Program comes in as an
object with the HostProgram interface (the real one, or `ninfer_jax.testing.FakeProgram`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import numbers
import os
import queue
import threading
import time
from typing import Any

from ninfer_jax import display
from ninfer_jax.engine.catalog import CatalogEntry, CatalogStats, CheckpointCatalog
from ninfer_jax.engine.events import (
    Channel,
    Delta,
    Finished,
    FinishReason,
    GenerationStart,
    RejectedError,
    TokenLogprob,
    Usage,
)
from ninfer_jax.engine.handle import AsyncRequestHandle, CapacityToken, EventSink, RequestHandle
from ninfer_jax.engine.request import InvariantError, RequestRecord, RequestState
from ninfer_jax.engine.resources import LaneState, ResourceManager
from ninfer_jax.engine.scheduler import ControlUnit, DecodeUnit, PrefillUnit, Scheduler
from ninfer_jax.engine.spec_policy import DraftPolicy, RowAcceptance, RowOutlook
from ninfer_jax.engine.spec_stats import SpeculativeStats
from ninfer_jax.engine.tiers import ContextTiers, TierStats
from ninfer_jax.engine.transactions import TransactionStats, Transition
from ninfer_jax.errors import ConfigError
from ninfer_jax.frontend.media import identity_of
from ninfer_jax.frontend.output_session import FinishReason as TextFinish
from ninfer_jax.frontend.output_session import ending_ids
from ninfer_jax.frontend.prompt import PreparedPrompt
from ninfer_jax.program.pending import BatchKind
from ninfer_jax.sampling_params import SamplingParams

log = logging.getLogger(__name__)
S = RequestState


@dataclasses.dataclass(frozen=True)
class EngineCoreConfig:
    max_queue: int = 64  # outstanding requests (waiting + running + unconsumed) before overload
    queue_timeout_s: float | None = None  # default time a request may wait for admission
    idle_wait_s: float = 0.05
    prefix_reuse: bool = True  # checkpoint prompts and turns; reuse the longest exact prefix
    backfill_window: int = 8  # waiting requests behind a blocked head that may borrow
    # Dispatch a decode round before the previous round's output is turned into events, so
    # the host's work per round runs while the device computes (see `_run_unit`).
    overlap: bool = True

    def __post_init__(self):
        for name in ("max_queue", "backfill_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r:.40}")
        for name in ("queue_timeout_s", "idle_wait_s"):
            value = getattr(self, name)
            if value is None and name == "queue_timeout_s":
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                    or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"{name} must be a finite number of seconds > 0, "
                                  f"got {value!r:.40}")
        for name in ("prefix_reuse", "overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r:.40}")


@dataclasses.dataclass(frozen=True)
class RoundStats:
    """The worker's decode rounds and where its time went in the iterations that ran them."""

    rounds: int = 0  # decode rounds dispatched (an aborted round ahead included)
    rows: int = 0  # their rows
    host_s: float = 0.0  # worker time in those iterations, less waiting for a round's tokens
    wait_s: float = 0.0  # waiting for a round's tokens: the host was ahead of the device

    @property
    def host_us_per_round(self) -> float:
        return 1e6 * self.host_s / max(self.rounds, 1)

    @property
    def host_us_per_row(self) -> float:
        return 1e6 * self.host_s / max(self.rows, 1)


@dataclasses.dataclass(frozen=True)
class EngineStats:
    """The worker's published summary, replaced whole after every iteration and before any
    event it publishes: a consumer that has read an event reads stats that account for it."""

    available: bool
    waiting: int
    active: int
    outstanding: int
    capacity: int
    free_lanes: int
    total_lanes: int
    free_pages: int
    total_pages: int
    reserved_pages: int
    free_slots: int
    total_slots: int
    generated_tokens: int
    finished_requests: int
    backfilled: int  # requests admitted ahead of a blocked head by the backfill proof
    prefix: CatalogStats
    speculative: SpeculativeStats
    transactions: TransactionStats  # resource transitions (`transactions.py`)
    tiers: TierStats  # the context store (tiers=() when the Engine has none)
    rounds: RoundStats = RoundStats()  # decode rounds and the worker's host time per round

    def _repr_html_(self) -> str:
        return display.stats_html(self)

    _repr_pretty_ = display.pretty(display.stats_line)


class EngineCore:
    def __init__(self, program: Any, frontend: Any, config: EngineCoreConfig = EngineCoreConfig(),
                 tiers: ContextTiers | None = None):
        """`tiers`: the context store that checkpoints are offloaded to and reloaded from
        (prefix reuse must be on); the EngineCore closes it."""
        self.program, self.frontend, self.config = program, frontend, config
        self.limits = program.limits
        self.scheduler = Scheduler()
        self.resources = ResourceManager(self.limits.max_concurrency)
        self.reuse = config.prefix_reuse and self.limits.total_checkpoint_slots > 0
        self.tiers = tiers if self.reuse else None
        if tiers is not None and self.tiers is None:
            tiers.close()
        self._to_offload: list[CatalogEntry] = []  # retained, blocks not yet sent to the store
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue[RequestRecord] = queue.SimpleQueue()
        self._sinks: dict[int, EventSink] = {}
        self._capacity: dict[int, CapacityToken] = {}
        self._active: list[RequestRecord] = []  # admitted, not yet Finished
        self._ids = itertools.count()
        self._order = itertools.count()
        self._lock = threading.Lock()  # guards outstanding / available for submitters
        self._outstanding = 0
        self._available = True
        self._failure: str | None = None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._generated = 0
        # Each decode round's K and what it measured (`spec_policy`); the rows' limits of the
        # rounds in flight by batch id.
        self._drafts = DraftPolicy(self.limits.round_drafts, self.limits.speculative)
        self._round_limits: dict[int, tuple[int, list[int]]] = {}
        self._finished = 0
        self._backfilled = 0
        # Committed round output (record, Frontend preview) not yet published: it goes out
        # while the next round computes, or before anything else is published.
        self._unpublished: list[tuple[RequestRecord, Any, Any]] = []
        self._blocked_on: tuple | None = None  # admission facts of the last failed attempt
        self._serving = False  # requests outstanding: background compiles are held
        # A dispatched decode round whose output is not processed yet, and its records: the
        # next round of the same rows is dispatched before it is (`_run_unit`).
        self._ahead: tuple[Any, list[RequestRecord]] | None = None
        self._rounds = [0, 0, 0.0, 0.0]  # RoundStats' fields, as the worker counts them
        self._publish_stats()
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)
        self._thread.start()

    # Submission (any thread) -----------------------------------------------------------------
    def submit(self, prompt: Any, sampling: SamplingParams, *, session_key: str | None = None,
               deadline_s: float | None = None, queue_timeout_s: float | None = None,
               cache_scope: str | None = None, prefix_reuse: bool = True,
               loop=None) -> RequestHandle:
        """Accepts a prepared prompt or raises RejectedError before anything is taken or mutated.

        Every argument is checked before the request takes outstanding capacity, so a refused
        call leaves the Engine exactly as it was. `cache_scope` isolates prefix reuse: a request
        reuses and publishes checkpoints only within its scope (a tenant, DESIGN §7).
        `prefix_reuse=False`: the request neither reads nor leaves a checkpoint."""
        self._check_submittable(prompt, sampling)
        deadline_s = _seconds("deadline_s", deadline_s)
        queue_timeout_s = _seconds("queue_timeout_s", queue_timeout_s)
        session_key = _optional_text("session", session_key)
        cache_scope = _optional_text("cache_scope", cache_scope)
        if not isinstance(prefix_reuse, bool):
            raise RejectedError("invalid", f"prefix_reuse must be a bool, got "
                                f"{prefix_reuse!r:.40}", "prefix_reuse")
        if sampling.temperature > 0 and sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=int.from_bytes(os.urandom(4), "little"))
        session = self.frontend.open_session(
            prompt, stop=sampling.stop, stop_token_ids=sampling.stop_token_ids,
            ignore_eos=sampling.ignore_eos, min_tokens=sampling.min_tokens,
            skip_special_tokens=sampling.skip_special_tokens,
            max_thinking_tokens=sampling.max_thinking_tokens)
        grammar = None
        if sampling.structured is not None:
            if session.channel.value == "thinking":
                raise RejectedError("invalid", "structured output constrains the answer from "
                                    "its first token: render the prompt with thinking off",
                                    "structured")
            try:
                grammar = self.frontend.grammar(self.limits.vocab_size).matcher(
                    sampling.structured)
                grammar.mask()  # the first token's, here on the caller's thread, not the worker
            except ValueError as e:
                raise RejectedError("invalid", f"structured: {e}", "structured") from None
        now = time.monotonic()
        qt = queue_timeout_s if queue_timeout_s is not None else self.config.queue_timeout_s
        sink = EventSink(loop)
        capacity = CapacityToken(self._release_capacity)
        with self._lock:
            if not self._available:
                raise RejectedError("unavailable", f"the Engine is not available: {self._failure}")
            if self._outstanding >= self.config.max_queue:
                raise RejectedError(
                    "overload", f"queue full: {self._outstanding} outstanding requests, "
                    f"max_queue is {self.config.max_queue}")
            record = RequestRecord(
                request_id=next(self._ids), prompt=prompt, sampling=sampling, session=session,
                submitted_at=now, queue_deadline=None if qt is None else now + qt,
                deadline=None if deadline_s is None else now + deadline_s,
                publication_order=next(self._order), session_key=session_key,
                cache_scope=cache_scope, reuse=prefix_reuse, grammar=grammar)
            self._outstanding += 1  # nothing below can fail: the capacity is never stranded
            self._sinks[record.request_id] = sink
            self._capacity[record.request_id] = capacity
            self._inbox.put(record)
        cls = AsyncRequestHandle if loop is not None else RequestHandle
        handle = cls(record.request_id, sink, record.cancel_requested, capacity, self.wake,
                     sampling.seed, getattr(getattr(self.frontend, "tokenizer", None), "decode",
                                            None))
        self.wake()
        return handle

    def _check_submittable(self, prompt: Any, sampling: SamplingParams) -> None:
        if not isinstance(prompt, PreparedPrompt):
            raise RejectedError("invalid", f"prompt must be a PreparedPrompt (Frontend.prepare), "
                                f"got {type(prompt).__name__}", "prompt")
        if not isinstance(sampling, SamplingParams):
            raise RejectedError("invalid", f"sampling must be a SamplingParams, got "
                                f"{type(sampling).__name__}", "sampling")
        n, lim = len(prompt.token_ids), self.limits
        b = prompt.reuse_boundary
        if b is not None and (isinstance(b, bool) or not isinstance(b, int) or not 0 < b < n):
            raise RejectedError("invalid", f"prompt.reuse_boundary must be None or an int in "
                                f"(0, {n}), got {b!r:.40}", "prompt")
        for i, t in enumerate(sampling.stop_token_ids):
            if t >= lim.vocab_size:
                raise RejectedError("invalid", f"stop_token_ids[{i}]: {t} is outside the "
                                    f"vocabulary [0, {lim.vocab_size})", "stop_token_ids")
        if n + 1 > lim.max_seq_len:
            raise RejectedError("too_long", f"prompt has {n} tokens; the context limit "
                                f"max_seq_len is {lim.max_seq_len} (prompt + at least 1 new token)",
                                "prompt")
        try:
            self.program.check_admissible(n, sampling.max_new_tokens)
        except ValueError as e:
            raise RejectedError("too_long", f"max_new_tokens: {e}", "max_new_tokens") from None
        if prompt.media:
            try:
                self.program.check_media(prompt.token_ids, prompt.media)
            except ValueError as e:
                raise RejectedError("invalid", f"messages: {e}", "messages") from None

    def _release_capacity(self) -> None:
        with self._lock:
            self._outstanding -= 1
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    def clear_prefix_cache(self, timeout: float = 30.0) -> None:
        """Releases every inactive checkpoint (on the worker thread); waits until done."""
        done = threading.Event()

        def clear() -> None:
            for entry in self.catalog.entries():
                self._drop_checkpoint(entry, evicted=False)
            done.set()

        self._commands.put(clear)
        self.wake()
        if not done.wait(timeout):
            raise TimeoutError("the Engine did not clear its prefix cache in time")

    # Life ------------------------------------------------------------------------------------
    def close(self, timeout: float = 10.0) -> None:
        """Stops the worker; unfinished requests end with an error."""
        self._stop.set()
        self.wake()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.program.close()
            if self.tiers is not None:
                self.tiers.close()

    def stats(self) -> EngineStats:
        """The worker's last snapshot (one object per publication)."""
        return self._stats

    @property
    def outstanding(self) -> int:
        """Requests holding capacity as of now: capacity also comes back on the consumer's side
        (a handle read or released), between the worker's snapshots."""
        with self._lock:
            return self._outstanding

    @property
    def catalog(self) -> CheckpointCatalog:
        """The ResourceManager's checkpoint catalog (prefix index, SessionIndex)."""
        return self.resources.catalog

    @property
    def available(self) -> bool:
        return self._available

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._iterate():
                    reading = self.tiers is not None and self.tiers.reads_in_flight
                    self._wake.wait(0.001 if reading else self.config.idle_wait_s)
                    self._wake.clear()
            self._fail("the Engine was closed", closing=True)
        except Exception as e:  # an internal invariant broke: fail the Engine (DESIGN §8)
            log.exception("Engine failure")
            self._fail(f"{type(e).__name__}: {e}")

    # One worker iteration (DESIGN §4) ---------------------------------------------------------
    def _iterate(self) -> bool:
        now = time.monotonic()
        progressed = self._take_inbox()
        if self._ahead is not None and not self._may_stay_ahead():
            self._land()  # anything but the next round of the same rows: process it first
        progressed |= self._run_commands()
        progressed |= self._expire_waiting(now)  # 1
        progressed |= self._advance_transitions(now)  # 2
        progressed |= self._advance_offloads()
        progressed |= self._settle_terminal()  # 3
        progressed |= self._freeze_cancellations(now)  # 4
        progressed |= self._try_admission()  # 5
        self._hold_compiles()
        unit = self.scheduler.next_unit(self._active)  # 6
        if unit is not None:
            waited = self._rounds[3]
            self._run_unit(unit)  # 7, 8, 9
            progressed = True
            if isinstance(unit, DecodeUnit):
                self._rounds[2] += time.monotonic() - now - (self._rounds[3] - waited)
        if not isinstance(unit, DecodeUnit):
            self._publish_committed()  # no round follows at once to overlap it with
            self._publish_stats()
        # A decode iteration published the stats with the previous round's deltas; its own
        # round is counted when its deltas go out, at the start of the next iteration's unit.
        return progressed

    def _hold_compiles(self) -> None:
        """Background compiles wait while requests are outstanding, so they never take the
        cores from a step being served; a step whose executable is still queued has it
        compiled first (`ExecutableTable.hold`)."""
        serving = bool(self._active or self.scheduler.waiting)
        if serving != self._serving:
            self._serving = serving
            self.program.hold_compiles(serving)

    def _run_commands(self) -> bool:
        ran = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return ran
            self._land()
            command()
            ran = True

    def _take_inbox(self) -> bool:
        took = False
        while True:
            try:
                self.scheduler.enqueue(self._inbox.get_nowait())
                took = True
            except queue.Empty:
                return took

    def _expire_waiting(self, now: float) -> bool:
        changed = False
        for r in list(self.scheduler.waiting):
            if r.cancel_requested.is_set():
                self.scheduler.remove(r)
                self._finish(r, FinishReason.CANCELLED)
                changed = True
            elif r.queue_deadline is not None and now >= r.queue_deadline:
                self.scheduler.remove(r)
                self._finish(r, FinishReason.ERROR, "queue_timeout: not admitted within the "
                             "request's queue timeout")
                changed = True
        return changed

    def _advance_transitions(self, now: float) -> bool:
        changed = False
        materializing = [r for r in self._active if r.state is S.MATERIALIZING]
        if self.tiers is not None and any(r.txn.reload is not None for r in materializing):
            self.tiers.poll()  # notes the reads that ended
        for r in materializing:
            expired = r.deadline is not None and now >= r.deadline
            if r.cancel_requested.is_set() or expired:
                reason = FinishReason.DEADLINE if expired and not r.cancel_requested.is_set() \
                    else FinishReason.CANCELLED
                self._abort_materialization(r, reason.value)
                self._active.remove(r)
                self._finish(r, reason)
                changed = True
                continue
            if r.txn.reload is not None:
                if not self.tiers.read_ended(r.txn.reload):
                    continue  # still reading; decode rounds go on meanwhile
                self._conclude_reload(r)
                changed = True
            # Capacity frees as active requests finish (the gate holds others back); with none
            # left to finish, inactive checkpoints may be evicted for it even as a borrower.
            alone = not any(x.seq is not None or x.materialized is not None
                            for x in self._active if x is not r)
            if r.materialized is None and not self._materialize(r, r.may_evict or alone):
                continue
            self._adopt_materialized(r)
            r.move(S.PREFILL)
            self._publish(r, GenerationStart(r.request_id, r.prompt_tokens, r.cached_tokens))
            changed = True
        return changed

    def _adopt_materialized(self, r: RequestRecord) -> None:
        """Adopts a committed materialization (its lane goes Active): the Engine owns the
        sequence from here."""
        result, r.materialized, r.txn = r.materialized, None, None
        self.resources.adopt(result, r.lane)
        r.seq, r.cached_tokens = result.sequence, result.cached_tokens

    def _abort_materialization(self, r: RequestRecord, reason: str) -> None:
        """A cancel or deadline while Materializing (DESIGN §3): a running transaction is
        aborted (a context-store read in flight is revoked: nothing was imported) and its lane
        freed; one committed but not yet adopted is adopted, then its sequence released."""
        if r.materialized is not None:
            self._adopt_materialized(r)
            self.resources.move(r.lane, LaneState.TERMINAL_PENDING, r.request_id)
            self._release(r)
            return
        txn, r.txn = r.txn, None
        if txn.reload is not None:
            self.tiers.abort_reload(txn.reload)
            txn.reload = None
        self.resources.adopt(txn.abort(reason), r.lane)

    def _settle_terminal(self) -> bool:
        settled = [r for r in self._active if r.state is S.TERMINAL_PENDING]
        for r in settled:
            self._adopt_terminal(r)
            self._active.remove(r)
            self._finish(r, r.finish_reason, r.error)
        return bool(settled)

    def _adopt_terminal(self, r: RequestRecord) -> None:
        """The terminal resource result (DESIGN §6), adopted before the client sees the end of
        the output: the turn's checkpoint is retained (when it can be kept) and the sequence
        released, so a follow-up sent on the last delta already finds the checkpoint."""
        if r.seq is None:
            return  # adopted already, before its last delta went out
        if r.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            entry = self._retain(r, publication=True)  # the turn's frontier
            if entry is not None and r.session_key is not None:
                self.catalog.bind_session(r.session_key, entry, r.publication_order)
        self._release(r)

    def _release(self, r: RequestRecord) -> None:
        """The RELEASE transaction of a terminal request's sequence; its lane goes Free."""
        txn = self.resources.begin(Transition.RELEASE, r.request_id)
        self.program.release(r.seq)
        self.resources.adopt(txn.commit(sequence=r.seq), r.lane)
        r.seq = None

    def _freeze_cancellations(self, now: float) -> bool:
        changed = False
        ahead = () if self._ahead is None else self._ahead[1]
        for r in self._active:
            if r.state not in (S.PREFILL, S.DECODE_READY, S.CONTROL_READY) or r in ahead:
                continue  # a row of the round ahead: its cancel is seen when that round lands
            if r.cancel_requested.is_set():
                self._terminal(r, FinishReason.CANCELLED)
                changed = True
            elif r.deadline is not None and now >= r.deadline:
                self._terminal(r, FinishReason.DEADLINE)
                changed = True
        return changed

    def _try_admission(self) -> bool:
        """Admits the FIFO head, evicting inactive checkpoints if it needs room; when the head is
        blocked by incumbents, lets one later request borrow if the backfill proof holds."""
        head = self.scheduler.head()
        if head is None or not Scheduler.prefill_gate_open(self._active):
            return False
        if self._admission_facts() == self._blocked_on:
            return False  # nothing that decides the outcome changed since it last failed
        admitted = self._admit(head, may_evict=True)
        if admitted:
            self.scheduler.unprotect()
        else:
            self.scheduler.protect(head, {r.request_id for r in self._active})
            for r in self.scheduler.backfill_candidates(self.config.backfill_window):
                if self._backfill_proven(head, r) and self._admit(r, may_evict=False):
                    self.scheduler.borrowers.add(r.request_id)
                    self._backfilled += 1
                    admitted = True
                    break
        # The facts after the attempt (it may have evicted or reloaded and still failed).
        self._blocked_on = None if admitted else self._admission_facts()
        return admitted

    def _admission_facts(self) -> tuple[int, int, int, int]:
        """What an admission attempt's outcome depends on (DESIGN §4): the Program's resources
        (its revision changes when capacity is claimed or released, a checkpoint captured,
        imported or released), the catalog's entries and bindings, the waiting requests (the
        head and the backfill candidates) and the free lanes."""
        return (self.program.resource_revision, self.catalog.version, self.scheduler.version,
                self.resources.num_free())

    def _backfill_proven(self, head: RequestRecord, r: RequestRecord) -> bool:
        """DESIGN §5: with `r` holding its full reservation, once the donors finish the head
        still enters from root with all inactive cache released."""
        if not any(x.request_id in self.scheduler.donors for x in self._active):
            return False  # nobody to wait for: the head goes next
        borrowers = [x for x in self._active if x.request_id in self.scheduler.borrowers]
        together = [head, r, *borrowers]
        return len(together) <= len(self.resources.lanes) and self.program.backfill_fits(
            [(x.prompt_tokens, x.sampling.max_new_tokens) for x in together])

    def _admit(self, r: RequestRecord, may_evict: bool) -> bool:
        """Claims a lane for `r` and moves it to Materializing: with a context-store read
        started (a revocable claim: the sequence is materialized when the read ends, see
        `_advance_transitions`), or with its sequence materialized now. False: it cannot start
        yet (nothing was taken)."""
        lane = self.resources.free_lane()
        if lane is None:
            return False
        reload = None
        if self.reuse and r.reuse and self.tiers is not None and not r.store_probed:
            reload = self._start_reload(r, may_evict)
        if reload is not None:  # a revocable claim until the read ends
            r.txn = self.resources.begin(Transition.MATERIALIZE, r.request_id)
            r.txn.reload = reload
        elif not self._materialize(r, may_evict):
            return False
        self.scheduler.remove(r)
        self.resources.move(lane, LaneState.MATERIALIZING, r.request_id)
        r.lane = lane
        r.may_evict = may_evict
        r.move(S.MATERIALIZING)
        self._active.append(r)
        return True

    def _materialize(self, r: RequestRecord, may_evict: bool) -> bool:
        """Plans `r` from its longest device checkpoint (evicting inactive ones if that makes
        it fit) and materializes its sequence: its MATERIALIZE transaction (the one waiting on
        a read, or a new one) commits, and the result waits in `r.materialized` to be adopted.
        False if it cannot start now (no transaction is started for that)."""
        reuse = self.reuse and r.reuse
        source = self.catalog.lookup(r.prompt.identity, r.session_key, r.cache_scope) \
            if reuse else None

        def ask(evictable=()):
            return self.program.admission(r.prompt_tokens, r.sampling.max_new_tokens,
                                          None if source is None else source.ckpt, evictable)

        victims = {v.ckpt: v for v in self.catalog.eviction_order(keep=source)} \
            if may_evict else {}
        answer = ask(list(victims))
        if not answer.fits and answer.evict:
            # Inactive cache is what stands in the way: release what the Program named (least
            # recently used first), then the plan it seals again fits.
            for ckpt in answer.evict:
                self._drop_checkpoint(victims[ckpt], evicted=True)
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
            self.catalog.record_use(source)
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

    def _start_reload(self, r: RequestRecord, may_evict: bool) -> Any:
        """Starts reading a checkpoint longer than the device's best from the context store
        (a Reload), or None. Probes the store once per request, and only when the request
        could start (the reload takes no capacity an active request was promised: it is
        planned like any admission, from pages nobody reserved and inactive checkpoints)."""
        source = self.catalog.lookup(r.prompt.identity, r.session_key, r.cache_scope)
        above = 0 if source is None else source.frontier
        if r.prompt_tokens - 1 <= above:
            return None
        victims = self.catalog.eviction_order(keep=source) if may_evict else []
        need = self.program.pages_needed(r.prompt_tokens, r.sampling.max_new_tokens) + 2
        if self.program.release_to_fit(need, [v.ckpt for v in victims]) is None:
            return None
        r.store_probed = True
        start = time.perf_counter()
        found = self.tiers.find(r.prompt.identity, r.cache_scope, above)
        return None if found is None else self.tiers.start_reload(found, start)

    def _conclude_reload(self, r: RequestRecord) -> None:
        """Imports the checkpoint a finished read brought (when it checks out and fits)."""
        reload, r.txn.reload = r.txn.reload, None
        image = self.tiers.reload_result(reload)
        found = reload.found
        if image is None or self.catalog.get(found.tokens, r.cache_scope) is not None:
            return
        # The blocks are read before evicting on the device: a victim not yet in the store is
        # written there first, and that write may evict the blocks just found.
        source = self.catalog.lookup(r.prompt.identity, r.session_key, r.cache_scope)
        victims = self.catalog.eviction_order(keep=source) if r.may_evict else []
        for victim in victims:
            if self.program.can_import(found.frontier):
                break
            self._drop_checkpoint(victim, evicted=True)
        if not self.program.can_import(found.frontier):
            return
        place = self.resources.begin(Transition.PLACE, r.request_id)
        if r.prompt.identity_ids is not None:  # the store holds identities: the real prefix
            f = found.frontier
            image = dataclasses.replace(image, tokens=tuple(r.prompt.token_ids[:f]),
                                        media=r.prompt.media_before(f))
        ckpt = self.program.import_checkpoint(image)
        self.resources.adopt(place.commit(checkpoint=ckpt, tokens=found.tokens,
                                          scope=r.cache_scope))
        self.tiers.record_reload(found, time.perf_counter() - reload.started)

    def _advance_offloads(self) -> bool:
        """Sends retained checkpoints to the context store and concludes finished writes."""
        if self.tiers is None:
            return False
        offloaded = bool(self._to_offload)
        while self._to_offload:
            self._offload(self._to_offload.pop(0))
        return self.tiers.poll() or offloaded

    def _offload(self, entry: CatalogEntry) -> None:
        self.tiers.offload(self.program, entry.ckpt, entry.tokens, entry.scope)

    def _retain(self, r: RequestRecord, tokens=None, publication: bool = False
                ) -> CatalogEntry | None:
        """Checkpoints a sequence at its committed frontier unless that prefix is cataloged;
        evicts the least recently used checkpoint for a slot. None when nothing is kept.
        `tokens`: the frontier's tokens (default: all but the last, whose effect is not in the
        state yet). `publication`: the turn's checkpoint, into the slot reserved at
        activation when the request holds one (an unused one is freed with the sequence)."""
        if not (self.reuse and r.reuse):
            return None
        if tokens is None:
            tokens = self.program.tokens(r.seq)[:-1]
        tokens = identity_of(tokens, r.prompt.identity_ids, len(tokens))  # what lookup compares
        if len(tokens) != self.program.frontier(r.seq):
            raise InvariantError(f"request {r.request_id}: retain of {len(tokens)} tokens at "
                                 f"frontier {self.program.frontier(r.seq)}")
        existing = self.catalog.get(tokens, r.cache_scope)
        if existing is not None:
            self.catalog.touch(existing)  # reached again: the last to evict
            return existing
        reserved = publication and self.program.has_publication_slot(r.seq)
        if not reserved and not self.program.can_capture():
            victim = self.catalog.least_recent()
            if victim is None:
                return None
            self._drop_checkpoint(victim, evicted=True)
        txn = self.resources.begin(Transition.CAPTURE, r.request_id)
        ckpt = self.program.capture(r.seq, publication=reserved)
        entry = self.resources.adopt(txn.commit(checkpoint=ckpt, tokens=tokens,
                                                scope=r.cache_scope))
        if self.tiers is not None:  # written through once this iteration's output is out
            self._to_offload.append(entry)
        return entry

    def _prompt_kept_at_end(self, r: RequestRecord) -> bool:
        """Whether the prompt's checkpoint is at its end rather than at the start of its last
        prefill chunk: with a reuse boundary (checkpointed there too), a prompt of one chunk (a
        repeat runs one chunk either way), or a one-token request (its turn's checkpoint is at
        the prompt's end: a second state image for one prompt is not worth a chunk)."""
        return (r.prompt.reuse_boundary is not None or r.sampling.max_new_tokens == 1
                or len(r.prompt.token_ids) <= self.limits.prefill_chunk)

    def _drop_checkpoint(self, entry: CatalogEntry, evicted: bool, keep: bool = True) -> None:
        """Releases a device checkpoint; with `keep`, one not yet in the context store goes
        there first."""
        if entry in self._to_offload:
            self._to_offload.remove(entry)
            if keep:
                self._offload(entry)
        txn = self.resources.begin(Transition.DELETE)
        self.program.release_checkpoint(entry.ckpt)
        self.resources.adopt(txn.commit(checkpoint=entry.ckpt, tokens=entry.tokens,
                                        scope=entry.scope, evicted=evicted))

    def _run_unit(self, unit: ControlUnit | PrefillUnit | DecodeUnit) -> None:
        if isinstance(unit, PrefillUnit):
            self._publish_committed()
            r = unit.record
            boundary = r.prompt.reuse_boundary if self.reuse and r.reuse else None
            batch = self.program.prefill(r.seq, stop_at=boundary, mask=_mask(r))
            if batch is None:  # a middle chunk: the Program adopted it; nothing to publish
                frontier = self.program.frontier(r.seq)
                if boundary is not None and frontier == boundary:
                    # where the conversation's next turn leaves this prompt (the Frontend's
                    # boundary): that turn reuses everything before this answer from here
                    self._retain(r, r.prompt.token_ids[:boundary])
                elif not self._prompt_kept_at_end(r) and \
                        len(r.prompt.token_ids) - frontier <= self.limits.prefill_chunk:
                    # the start of the prompt's last chunk: the same prompt sent again (a
                    # retry, a regenerate) runs only that chunk, which it would run anyway to
                    # sample its first token (a checkpoint at the prompt's end cannot serve it)
                    self._retain(r, r.prompt.token_ids[:frontier])
                return
            records = [r]
        elif isinstance(unit, ControlUnit):
            self._publish_committed()
            r = unit.record
            records = [r]
            try:
                mask = None if r.grammar is None else r.grammar.mask_after(r.control)
            except ValueError as e:  # forced tokens the grammar refuses: this request ends
                self._terminal(r, FinishReason.ERROR, f"structured output: {e}")
                return
            batch = self.program.control(r.seq, r.control, mask)
        else:
            records = list(unit.records)
            if self._ahead is not None:
                if self._ahead[1] == records and self._chainable(records, ahead=True):
                    outlooks = self._chain_outlooks(records)
                    if outlooks is not None:  # the next round drafts nothing either
                        self._chain(records, outlooks)
                        return
                self._land()  # the round ahead first; the next iteration plans afresh
                return
            k, outlooks, caps, masks = self._plan_round(records)
            batch = self.program.decode([r.seq for r in records],
                                        None if all(c is None for c in caps) else caps,
                                        None if all(m is None for m in masks) else masks,
                                        drafts=k)
            self._dispatched(batch, k, outlooks)
            # The round runs on the device now: publish the previous round's committed output
            # meanwhile (its Program commit is done; reading batch.tokens waits for this one).
            self._publish_committed()
            if k == 0 and self._chainable(records, ahead=False):
                self._ahead = (batch, records)  # the next iteration dispatches the next round
                return
        self._commit_and_publish(batch, records)

    def _plan_round(self, records: list[RequestRecord]) -> tuple:
        """The next decode round of these rows: (its K, the rows' RowOutlooks, caps, masks).
        A row may not run past the point where its Frontend will force control (counting the
        previous round, committed but not yet published to its session); grammar rows get the
        mask of their next token (the matcher is at the committed output) and, like rows of
        requests with speculative="off", draft nothing."""
        unpublished = {r.request_id: p for r, p, _ in self._unpublished}
        caps = [r.session.tokens_before_control(unpublished.get(r.request_id))
                for r in records]
        masks = [_mask(r) for r in records]
        outlooks = []
        for r, cap, mask in zip(records, caps, masks):
            budget = r.sampling.max_new_tokens - r.completion_tokens
            budget = budget if cap is None else min(budget, cap)
            drafts = mask is None and r.sampling.speculative == "on"
            if drafts and r.acceptance is None:
                r.acceptance = RowAcceptance(self.limits.verify_width - 1)
            outlooks.append(RowOutlook(r.acceptance if drafts else None, budget))
        k = self._drafts.choose(outlooks, self.program.round_ready)
        if k:  # rows that draft nothing propose one token
            caps = [o.budget if o.acceptance is not None else 1 for o in outlooks]
        return k, outlooks, caps, masks

    def _chain_outlooks(self, records: list[RequestRecord]) -> list[RowOutlook] | None:
        """The rows' outlooks when their next round, chained ahead, drafts nothing (None:
        the policy would draft). Chainable rows have no control, grammar or thinking budget
        ahead, so their budgets are their tokens left."""
        outlooks = [RowOutlook(r.acceptance if r.sampling.speculative == "on" else None,
                               r.sampling.max_new_tokens - r.completion_tokens)
                    for r in records]
        if self._drafts.adaptive and self._drafts.choose(outlooks, self.program.round_ready):
            return None
        return outlooks

    def _dispatched(self, batch: Any, k: int, outlooks: list[RowOutlook]) -> None:
        self._drafts.dispatched(k, outlooks)
        if k:  # a round of 0 proposes one token a row
            self._round_limits[batch.batch_id] = (
                k, [1 if o.acceptance is None else max(1, min(k + 1, o.budget))
                    for o in outlooks])
        self._count_round(len(outlooks))

    # Rounds ahead (EngineCoreConfig.overlap) -------------------------------------------------
    def _chainable(self, records: list[RequestRecord], ahead: bool) -> bool:
        """Whether the next round of these rows may be dispatched before this one's output is
        processed: plain decode rows (a round of no drafts; no grammar or thinking budget:
        nothing the next round needs from this one's text), none cancelled or past its
        deadline, and budget for a token after this round's (`ahead`: this round's is not
        counted yet)."""
        if not self.config.overlap:
            return False
        now = time.monotonic()
        spent = 2 if ahead else 1
        return all(r.grammar is None and r.sampling.max_thinking_tokens is None
                   and not r.control and not r.cancel_requested.is_set()
                   and (r.deadline is None or now < r.deadline)
                   and r.completion_tokens + spent < r.sampling.max_new_tokens
                   for r in records)

    def _may_stay_ahead(self) -> bool:
        """The round ahead may stay unprocessed through this iteration: its rows are all that
        is active and nothing waits, so the iteration can only continue them."""
        rows = self._ahead[1]
        return (not self.scheduler.waiting and len(self._active) == len(rows)
                and all(r.state is S.DECODE_READY for r in rows) and not self._to_offload
                and (self.tiers is None or not self.tiers.reads_in_flight)
                and self._chainable(rows, ahead=True))

    def _chain(self, records: list[RequestRecord], outlooks: list[RowOutlook]) -> None:
        """Publishes the round before, commits the round ahead in the Program (one token a
        row, not yet read), dispatches the next round of the same rows (it takes those tokens
        on the device), then turns the committed round into events while the next computes.
        A row whose output ended with it (or that needs forced control) drops the new round."""
        batch, _ = self._ahead
        _check_membership(batch, records)
        self._publish_committed()
        self.program.commit(batch, [1] * len(records))  # DESIGN §6: commit before publish
        self._ahead = (self.program.decode([r.seq for r in records], drafts=0), records)
        self._dispatched(self._ahead[0], 0, outlooks)
        self._commit_and_publish(batch, records, committed=True)
        if any(r.state is not S.DECODE_READY for r in records):
            self._drop_ahead()

    def _count_round(self, rows: int) -> None:
        self._rounds[0] += 1
        self._rounds[1] += rows

    def _drop_ahead(self) -> None:
        """Aborts the round ahead: the Engine stands where it would have without overlap (its
        rows that go on compute their round again next, the same tokens: a draw is keyed by
        seed and position)."""
        batch, _ = self._ahead
        self._ahead = None
        self._round_limits.pop(batch.batch_id, None)
        self.program.abort_pending(batch)

    def _land(self) -> None:
        """Processes the round ahead, if any, as a round is processed without overlap (its
        previews after the round before is published, then the Program commit: a row
        cancelled meanwhile takes none of its tokens)."""
        if self._ahead is None:
            return
        batch, records = self._ahead
        self._ahead = None
        self._publish_committed()
        self._commit_and_publish(batch, records)

    def _commit_and_publish(self, batch: Any, records: list[RequestRecord],
                            committed: bool = False) -> None:
        """Previews each row's tokens, commits the Program, then the previews, and queues their
        deltas for publication. `committed`: the Program committed the round already, one
        token a row (a round ahead, `_chain`), which the previews must agree with."""
        _check_membership(batch, records)
        start = time.monotonic()
        batch.tokens  # noqa: B018 - waits for the round's step: counted apart from host work
        now = time.monotonic()
        self._rounds[3] += now - start
        k, limits = self._round_limits.pop(batch.batch_id, (0, None))
        previews, accepted = [], []
        for row, r in enumerate(records):
            if not committed and r.cancel_requested.is_set():
                # seen while the batch was pending: accept nothing
                previews.append(None)
                accepted.append(0)
                continue
            forced = list(batch.forced)  # forced control's tokens come before the sampled one
            tokens = forced + batch.row_tokens(row)  # never past the budget
            budget_ends = r.completion_tokens + len(tokens) >= r.sampling.max_new_tokens
            preview = r.session.preview(tokens, budget_ends=budget_ends, forced=len(forced))
            if preview.num_accepted <= len(forced):
                raise InvariantError(f"request {r.request_id}: a preview accepted no sampled "
                                     "token")
            previews.append(preview)
            accepted.append(preview.num_accepted - len(forced))
        if batch.kind is BatchKind.DECODE:
            self._drafts.round_done(k, len(records), now, sum(accepted))
        else:
            self._drafts.interrupt()
        if not committed:
            self.program.commit(batch, accepted)  # Program state first; a failure publishes none
        elif accepted != [1] * len(records):
            raise InvariantError(f"a round committed ahead with one token a row previewed "
                                 f"{accepted}")
        if batch.kind is BatchKind.PREFILL and accepted[0] > 0 and \
                self._prompt_kept_at_end(records[0]):
            self._retain(records[0])  # the prompt's frontier
        for row, (r, preview, n) in enumerate(zip(records, previews, accepted)):
            r.control = ()
            if preview is None:
                self._terminal(r, FinishReason.CANCELLED)
                continue
            if batch.kind is BatchKind.DECODE and k:
                self._drafts.add_row(r.acceptance, k, limits[row], int(batch.produced[row]), n)
            n = preview.num_accepted  # the forced tokens too: they are output
            r.completion_tokens += n
            self._generated += n
            logprobs = None
            if r.sampling.logprobs is not None:
                forced = batch.forced  # forced control: no draw, reported as certain
                logprobs = tuple(TokenLogprob(t, 0.0) for t in preview.token_ids[:len(forced)])
                logprobs += tuple(
                    TokenLogprob(t, lp, top[: r.sampling.logprobs]) for t, (lp, top) in
                    zip(preview.token_ids[len(forced):], batch.row_logprobs(row)))
            self._unpublished.append((r, preview, logprobs))  # after the next round starts
            if r.grammar is not None and not r.grammar.advance(preview.token_ids) \
                    and preview.finish_reason is None:  # a token the grammar refuses
                self._terminal(r, FinishReason.ERROR, f"structured output: {r.grammar.error}")
            elif preview.finish_reason is not None:
                reason = FinishReason.STOP if preview.finish_reason is TextFinish.STOP \
                    else FinishReason.LENGTH
                r.stop_string = preview.stop_string
                self._terminal(r, reason)
            elif preview.control:
                self._ask_control(r, preview.control)
            elif forced := _grammar_forced(r, self.limits.prefill_chunk - 1):
                self._ask_control(r, forced)
            else:
                r.move(S.DECODE_READY)

    def _ask_control(self, r: RequestRecord, tokens: tuple[int, ...]) -> None:
        """ControlReady (DESIGN §3): the Frontend's forced tokens go next. A budget too small
        for them and one token after them ends the output here (the Frontend's limit, e.g. a
        thinking budget, must not be overrun)."""
        if r.completion_tokens + len(tokens) + 1 > r.sampling.max_new_tokens:
            self._terminal(r, FinishReason.LENGTH)
            return
        r.control = tokens
        r.move(S.CONTROL_READY)

    def _publish_committed(self) -> None:
        """Commits the Frontend previews of committed rounds and publishes their deltas, in
        order (DESIGN §6: the Program commit of each came first)."""
        if self._unpublished:
            self._publish_stats()  # first: stats read after a delta count its tokens
        while self._unpublished:
            r, preview, logprobs = self._unpublished.pop(0)
            if r.state is S.TERMINAL_PENDING:
                self._adopt_terminal(r)  # the terminal result first, then the last delta
            r.session.commit(preview)
            ids = tuple(preview.token_ids)
            channel = Channel((preview.deltas[0].channel if preview.deltas
                               else r.session.channel).value)
            if channel is Channel.THINKING:  # the tokens go with the first delta's channel
                r.reasoning_tokens += len(ids)
            if not preview.deltas:
                self._emit(r, Delta(r.request_id, "", ids, channel, logprobs))
            for i, d in enumerate(preview.deltas):
                self._emit(r, Delta(r.request_id, d.text, ids if i == 0 else (),
                                    Channel(d.channel.value), logprobs if i == 0 else None))

    # Endings ---------------------------------------------------------------------------------
    def _terminal(self, r: RequestRecord, reason: FinishReason, error: str | None = None) -> None:
        r.move(S.TERMINAL_PENDING)
        r.finish_reason, r.error = reason, error
        self.resources.move(r.lane, LaneState.TERMINAL_PENDING, r.request_id)

    def _finish(self, r: RequestRecord, reason: FinishReason, error: str | None = None, *,
                force: bool = False) -> None:
        if force:  # failure cleanup: every lifecycle ends here, whatever state it was in
            r.state = S.FINISHED
        else:
            r.move(S.FINISHED)
        self._finished += 1
        usage = Usage(r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.reasoning_tokens)
        # response_done first: a consumer that has read Finished (consumer_released) has its
        # capacity back at once, so it may submit again without a spurious overload.
        self._capacity.pop(r.request_id).response_done()
        self._publish_stats()  # stats read after Finished count the request
        self._publish(r, Finished(r.request_id, reason, usage, error, r.stop_string))
        self._sinks.pop(r.request_id, None)

    def _publish(self, r: RequestRecord, event: Any) -> None:
        self._publish_committed()  # committed output first: nothing overtakes a delta
        self._emit(r, event)

    def _emit(self, r: RequestRecord, event: Any) -> None:
        sink = self._sinks.get(r.request_id)
        if sink is not None:
            sink.put(event)

    def _fail(self, message: str, closing: bool = False) -> None:
        """Ends everything (DESIGN §8): Program's pending work, active state, RM, responses."""
        with self._lock:  # after this no submit can reach the inbox
            self._available = False
            self._failure = message
        self._ahead = None
        self._round_limits.clear()
        pending = self.program.pending
        if pending is not None and not pending.consumed:
            _best_effort(self.program.abort_pending, pending)
        for handle in self.program.handles():
            _best_effort(self.program.release, handle)
        for r in self._active:
            r.seq = r.materialized = None  # released above: no result is adopted any more
            if r.txn is not None and r.txn.reload is not None:
                _best_effort(self.tiers.abort_reload, r.txn.reload)
                r.txn.reload = None
            r.txn = None  # the ResourceManager's clear ends it
        # A clean close still stores what it retained where that outlives the process (a
        # host-memory tier does not: exporting to it would only delay the exit).
        keep = closing and self.tiers is not None and self.tiers.outlives_process
        for entry in self.catalog.entries():
            _best_effort(self._drop_checkpoint, entry, False, keep)
        self.resources.clear()
        error = message if closing else f"engine_failed: {message}"
        for r in self._active + list(self.scheduler.waiting) + self._drain_inbox():
            if r.state is not S.FINISHED:
                self._finish(r, FinishReason.ERROR, error, force=True)
        self._active.clear()
        self.scheduler.waiting.clear()
        self._publish_stats()

    def _drain_inbox(self) -> list[RequestRecord]:
        out = []
        while True:
            try:
                out.append(self._inbox.get_nowait())
            except queue.Empty:
                return out

    def _publish_stats(self) -> None:
        ps = self.program.stats()
        with self._lock:
            outstanding, available = self._outstanding, self._available
        self._stats = EngineStats(
            available=available, waiting=len(self.scheduler.waiting), active=len(self._active),
            outstanding=outstanding, capacity=self.config.max_queue,
            free_lanes=self.resources.num_free(), total_lanes=len(self.resources.lanes),
            free_pages=ps.free_pages, total_pages=ps.total_pages,
            reserved_pages=ps.reserved_pages, free_slots=ps.free_slots,
            total_slots=ps.total_slots, generated_tokens=self._generated,
            finished_requests=self._finished, backfilled=self._backfilled,
            prefix=self.catalog.stats(*self.program.checkpoint_footprint()),
            speculative=self._drafts.stats(),
            transactions=self.resources.transactions.stats(),
            tiers=self.tiers.stats() if self.tiers is not None else TierStats(()),
            rounds=RoundStats(*self._rounds))


def _check_membership(batch: Any, records: list[RequestRecord]) -> None:
    if [r.seq for r in records] != list(batch.handles):
        raise InvariantError(f"PendingBatch membership {batch.handles} != round {records}")


def _grammar_forced(r: RequestRecord, most: int) -> tuple[int, ...]:
    """A grammar row's fast-forward (`GrammarMatcher.forced`): at most `most` tokens (one
    control step's; the rest follows the next sampled token) and one short of the budget, so
    a sampled token follows them. None for a request with stop strings or stop ids: forced
    text is never matched against them, and the grammar's text could hold one."""
    if r.grammar is None or r.sampling.stop or r.sampling.stop_token_ids:
        return ()
    room = r.sampling.max_new_tokens - r.completion_tokens - 1
    return r.grammar.forced()[:max(min(room, most), 0)]


def _mask(r: RequestRecord) -> Any:
    """The allowed-token mask of a grammar row's next token (None: unconstrained)."""
    return None if r.grammar is None else r.grammar.mask()


def _seconds(name: str, value: Any) -> float | None:
    """A time limit in seconds: None, or a finite number > 0 (NaN would never fire)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value <= 0:
        raise RejectedError("invalid", f"{name} must be a finite number of seconds > 0, "
                            f"got {value!r:.40}", name)
    return float(value)


def _optional_text(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise RejectedError("invalid", f"{name} must be a string or None, got "
                            f"{type(value).__name__}", name)
    return value


def _best_effort(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # cleanup after a failure must reach every request
        log.exception("cleanup step %s failed", getattr(fn, "__name__", fn))

