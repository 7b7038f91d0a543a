"""EngineCore: the worker thread that alone drives records, Scheduler, ResourceManager and Program.

Owns the worker loop: the boundary order of DESIGN §4, the request lifecycle of §3 (its moves
between states), running each scheduled unit on the Program, the commit-then-publish order of
§6 and the cancellation and failure rules of §8. Other threads reach it only through `submit`
(a queue), a request's cancellation flag, and the events it publishes. Imports no jax: the
Program is any HostProgram (the real one, or `ninfer_jax.testing.FakeProgram`).

A request's path (the modules each step belongs to):
1. `submit` (the caller's thread): `submission.check_request` refuses bad input naming the
   field; the Frontend opens its OutputSession (and grammar matcher); a RequestRecord takes
   outstanding capacity and goes to the inbox; the caller gets a RequestHandle whose EventSink
   and CapacityToken `publication.Publication` holds.
2. Each iteration (`_iterate`), in DESIGN §4's order: the inbox joins the Scheduler's FIFO;
   waiting requests past their queue timeout or cancelled end; Materializing requests advance
   (`admission.Admission`: a context-store read concluded by `retention.Retention`, the
   sequence materialized from a sealed plan and adopted; GenerationStart published); terminal
   requests settle (their turn checkpoint retained, the sequence released, Finished published);
   cancels and deadlines freeze; `Admission.try_admit` admits the head or a backfill borrower.
3. The Scheduler picks one unit: a prefill chunk (`HostProgram.prefill`, checkpoints at the
   reuse boundary or the last chunk's start), forced control (`HostProgram.control`), or a
   decode round of all decode-ready rows (`rounds.Rounds.plan` chooses its drafts, caps and
   masks; `HostProgram.decode` returns a PendingBatch computing on the device).
4. `_commit_and_publish`: each row's tokens are previewed by its OutputSession (stop strings,
   budget, control), the Program commits exactly the accepted tokens, and only then are the
   deltas queued; `Publication.flush` sends them while the next round computes (overlap: a
   round of no drafts for the same rows is dispatched before this one's output is processed,
   `_chain`).
5. A preview that ends the output moves the request to TerminalPending; step 2 of a later
   iteration settles it and publishes Finished, the request's last event.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

from ninfer_jax.engine.admission import Admission
from ninfer_jax.engine.catalog import CheckpointCatalog
from ninfer_jax.engine.config import EngineCoreConfig
from ninfer_jax.engine.events import Finished, FinishReason, GenerationStart, RejectedError, Usage
from ninfer_jax.engine.handle import AsyncRequestHandle, CapacityToken, EventSink, RequestHandle
from ninfer_jax.engine.publication import Publication, check_rows, preview_rows
from ninfer_jax.engine.request import RequestRecord, RequestState
from ninfer_jax.engine.resources import LaneState, ResourceManager
from ninfer_jax.engine.retention import Retention
from ninfer_jax.engine.rounds import RoundPlan, Rounds, chainable
from ninfer_jax.engine.scheduler import ControlUnit, DecodeUnit, PrefillUnit, Scheduler
from ninfer_jax.engine.stats import EngineStats
from ninfer_jax.engine.submission import check_request, open_output, optional_text, seconds
from ninfer_jax.engine.tiers import ContextTiers, TierStats
from ninfer_jax.frontend.output_session import FinishReason as TextFinish
from ninfer_jax.frontend.prompt import PreparedPrompt
from ninfer_jax.program.host import HostProgram
from ninfer_jax.program.pending import BatchKind, PendingBatch
from ninfer_jax.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ninfer_jax.frontend.loading import Frontend

log = logging.getLogger(__name__)
S = RequestState


class EngineCore:
    def __init__(self, program: HostProgram, frontend: Frontend,
                 config: EngineCoreConfig | None = None, tiers: ContextTiers | None = None):
        """`tiers`: the context store that checkpoints are offloaded to and reloaded from
        (prefix reuse must be on); the EngineCore closes it."""
        config = EngineCoreConfig() if config is None else config
        self.program, self.frontend, self.config = program, frontend, config
        self.limits = program.limits
        self.scheduler = Scheduler()
        self.resources = ResourceManager(self.limits.max_concurrency)
        self.reuse = config.prefix_reuse and self.limits.total_checkpoint_slots > 0
        self.tiers = tiers if self.reuse else None
        if tiers is not None and self.tiers is None:
            tiers.close()
        self.retention = Retention(program, self.resources, self.tiers, self.reuse)
        self.admission = Admission(program, frontend, self.scheduler, self.resources,
                                   self.retention, config.backfill_window)
        self.rounds = Rounds(self.limits)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox: queue.SimpleQueue[RequestRecord] = queue.SimpleQueue()
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
        self._finished = 0
        self._serving = False  # requests outstanding: background compiles are held
        # A dispatched decode round whose output is not processed yet, and its records: the
        # next round of the same rows is dispatched before it is (`_run_unit`).
        self._ahead: tuple[PendingBatch, list[RequestRecord]] | None = None
        self.publication = Publication(self._snapshot, self._adopt_terminal)
        self._thread = threading.Thread(target=self._run, name="ninfer-engine", daemon=True)
        self._thread.start()

    # Submission (any thread) -----------------------------------------------------------------
    def submit(self, prompt: PreparedPrompt, sampling: SamplingParams, *,
               session_key: str | None = None, deadline_s: float | None = None,
               queue_timeout_s: float | None = None, cache_scope: str | None = None,
               prefix_reuse: bool = True, loop=None) -> RequestHandle:
        """Accepts a prepared prompt or raises RejectedError before anything is taken or mutated.

        Every argument is checked before the request takes outstanding capacity, so a refused
        call leaves the Engine exactly as it was. `cache_scope` isolates prefix reuse: a request
        reuses and publishes checkpoints only within its scope (a tenant, DESIGN §7).
        `prefix_reuse=False`: the request neither reads nor leaves a checkpoint."""
        check_request(self.program, prompt, sampling)
        deadline_s = seconds("deadline_s", deadline_s)
        queue_timeout_s = seconds("queue_timeout_s", queue_timeout_s)
        session_key = optional_text("session", session_key)
        cache_scope = optional_text("cache_scope", cache_scope)
        if not isinstance(prefix_reuse, bool):
            raise RejectedError("invalid", f"prefix_reuse must be a bool, got "
                                f"{prefix_reuse!r:.40}", "prefix_reuse")
        sampling, session, grammar = open_output(self.frontend, prompt, sampling,
                                                 self.limits.vocab_size)
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
            self.publication.open(record.request_id, sink, capacity)
            self._inbox.put(record)
        cls = AsyncRequestHandle if loop is not None else RequestHandle
        handle = cls(record.request_id, sink, record.cancel_requested, capacity, self.wake,
                     sampling.seed, self.frontend.tokenizer.decode)
        self.wake()
        return handle

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
                self.retention.drop(entry, evicted=False)
            done.set()

        self._commands.put(clear)
        self.wake()
        if not done.wait(timeout):
            raise TimeoutError("the Engine did not clear its prefix cache in time")

    def _idle(self) -> bool:
        return not (self._active or self.scheduler.waiting)

    def wait_warm(self, timeout: float = 600.0) -> None:
        """Returns once the idle worker has run every compiled decode round once
        (`Program.warm_up_next`), or as soon as requests are being served (their rounds then
        run the rest), or the worker stopped."""
        deadline = time.monotonic() + timeout
        while getattr(self.program, "cold_rounds", 0) and self._idle() \
                and self._thread.is_alive() and time.monotonic() < deadline:
            self.wake()
            time.sleep(0.002)

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
        return self.publication.stats

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
                    if self._idle() and self.program.warm_up_next():
                        continue  # idle: an executable's first run now, not in a request's
                    reading = self.retention.reads_in_flight
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
        progressed |= self.retention.advance_offloads()
        progressed |= self._settle_terminal()  # 3
        progressed |= self._freeze_cancellations(now)  # 4
        progressed |= self.admission.try_admit(self._active)  # 5
        self._hold_compiles()
        unit = self.scheduler.next_unit(self._active)  # 6
        if unit is not None:
            waited = self.rounds.wait_s
            self._run_unit(unit)  # 7, 8, 9
            progressed = True
            if isinstance(unit, DecodeUnit):
                self.rounds.counted(
                    host_s=time.monotonic() - now - (self.rounds.wait_s - waited))
        if not isinstance(unit, DecodeUnit):
            self.publication.flush()  # no round follows at once to overlap it with
            self.publication.refresh_stats()
        # A decode iteration published the stats with the previous round's deltas; its own
        # round is counted when its deltas go out, at the start of the next iteration's unit.
        return progressed

    def _filling(self) -> bool:
        """`Admission.filling`, asked only where a draft policy chooses K (no work a round for
        a fixed or no-speculation Engine)."""
        return self.rounds.policy.adaptive and self.admission.filling()

    def _hold_compiles(self) -> None:
        """Background compiles wait while requests are outstanding, so they never take the
        cores from a step being served; a step whose executable is still queued has it
        compiled first (`ExecutableTable.hold`)."""
        serving = bool(self._active or self.scheduler.waiting)
        if serving != self._serving:
            self._serving = serving
            self.program.hold_compiles(serving)

    def _run_commands(self) -> bool:
        commands = _drained(self._commands)
        for command in commands:
            self._land()
            command()
        return bool(commands)

    def _take_inbox(self) -> bool:
        records = _drained(self._inbox)
        for r in records:
            self.scheduler.enqueue(r)
        return bool(records)

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
        self.retention.poll_reads(materializing)
        for r in materializing:
            expired = r.deadline is not None and now >= r.deadline
            if r.cancel_requested.is_set() or expired:
                reason = FinishReason.DEADLINE if expired and not r.cancel_requested.is_set() \
                    else FinishReason.CANCELLED
                self.admission.abort(r, reason.value)
                self._active.remove(r)
                self._finish(r, reason)
                changed = True
                continue
            if r.txn.reload is not None:
                if not self.retention.conclude_reload(r):
                    continue  # still reading; decode rounds go on meanwhile
                changed = True
            # Capacity frees as active requests finish (the gate holds others back); with none
            # left to finish, inactive checkpoints may be evicted for it even as a borrower.
            alone = not any(x.seq is not None or x.materialized is not None
                            for x in self._active if x is not r)
            if r.materialized is None and \
                    not self.admission.materialize(r, r.may_evict or alone):
                continue
            self.admission.adopt(r)
            r.move(S.PREFILL)
            self.publication.publish(
                r, GenerationStart(r.request_id, r.prompt_tokens, r.cached_tokens))
            changed = True
        return changed

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
            entry = self.retention.retain(r, publication=True)  # the turn's frontier
            if entry is not None and r.session_key is not None:
                self.catalog.bind_session(r.session_key, entry, r.publication_order)
        self.admission.release(r)

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

    def _run_unit(self, unit: ControlUnit | PrefillUnit | DecodeUnit) -> None:
        if isinstance(unit, PrefillUnit):
            self.publication.flush()
            r = unit.record
            boundary = r.prompt.reuse_boundary if self.reuse and r.reuse else None
            batch = self.program.prefill(r.seq, stop_at=boundary, mask=r.next_mask())
            if batch is None:  # a middle chunk: the Program adopted it; nothing to publish
                frontier = self.program.frontier(r.seq)
                if boundary is not None and frontier == boundary:
                    # where the conversation's next turn leaves this prompt (the Frontend's
                    # boundary): that turn reuses everything before this answer from here
                    self.retention.retain(r, r.prompt.token_ids[:boundary])
                elif not self.retention.prompt_kept_at_end(r) and \
                        len(r.prompt.token_ids) - frontier <= self.limits.prefill_chunk:
                    # the start of the prompt's last chunk: the same prompt sent again (a
                    # retry, a regenerate) runs only that chunk, which it would run anyway to
                    # sample its first token (a checkpoint at the prompt's end cannot serve it)
                    self.retention.retain(r, r.prompt.token_ids[:frontier])
                return
            records = [r]
        elif isinstance(unit, ControlUnit):
            self.publication.flush()
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
                    plan = self.rounds.chain_plan(records, self.program.round_ready,
                                                  bool(self.scheduler.waiting),
                                                  self.program.context_stale,
                                                  self._filling())
                    if plan is not None:  # the next round drafts nothing either
                        self._chain(records, plan)
                        return
                self._land()  # the round ahead first; the next iteration plans afresh
                return
            plan = self.rounds.plan(records, self.publication.queued_previews(),
                                    self.program.round_ready, bool(self.scheduler.waiting),
                                    self.program.context_stale, self._filling())
            batch = self.program.decode([r.seq for r in records], plan.caps, plan.masks,
                                        drafts=plan.drafts, bare=plan.bare)
            self.rounds.dispatched(batch, plan.drafts, plan.outlooks, plan.bare)
            # The round runs on the device now: publish the previous round's committed output
            # meanwhile (its Program commit is done; reading batch.tokens waits for this one).
            self.publication.flush()
            if plan.drafts == 0 and self._chainable(records, ahead=False):
                self._ahead = (batch, records)  # the next iteration dispatches the next round
                return
        self._commit_and_publish(batch, records)

    # Rounds ahead (EngineCoreConfig.overlap) -------------------------------------------------
    def _chainable(self, records: list[RequestRecord], ahead: bool) -> bool:
        return self.config.overlap and chainable(records, ahead)

    def _may_stay_ahead(self) -> bool:
        """The round ahead may stay unprocessed through this iteration: its rows are all that
        is active and nothing waits, so the iteration can only continue them."""
        rows = self._ahead[1]
        return (not self.scheduler.waiting and len(self._active) == len(rows)
                and all(r.state is S.DECODE_READY for r in rows)
                and not self.retention.writes_pending and not self.retention.reads_in_flight
                and self._chainable(rows, ahead=True))

    def _chain(self, records: list[RequestRecord], plan: RoundPlan) -> None:
        """Publishes the round before, commits the round ahead in the Program (one token a
        row, not yet read), dispatches the next round of the same rows (it takes those tokens
        on the device), then turns the committed round into events while the next computes.
        A row whose output ended with it (or that needs forced control) drops the new round."""
        batch, _ = self._ahead
        check_rows(batch, records)
        self.publication.flush()
        self.program.commit(batch, [1] * len(records))  # DESIGN §6: commit before publish
        self._ahead = (self.program.decode([r.seq for r in records], drafts=0,
                                           bare=plan.bare), records)
        self.rounds.dispatched(self._ahead[0], 0, plan.outlooks, plan.bare)
        self._commit_and_publish(batch, records, committed=True)
        if any(r.state is not S.DECODE_READY for r in records):
            self._drop_ahead()

    def _drop_ahead(self) -> None:
        """Aborts the round ahead: the Engine stands where it would have without overlap (its
        rows that go on compute their round again next, the same tokens: a draw is keyed by
        seed and position)."""
        batch, _ = self._ahead
        self._ahead = None
        self.rounds.dropped(batch)
        self.program.abort_pending(batch)

    def _land(self) -> None:
        """Processes the round ahead, if any, as a round is processed without overlap (its
        previews after the round before is published, then the Program commit: a row
        cancelled meanwhile takes none of its tokens)."""
        if self._ahead is None:
            return
        batch, records = self._ahead
        self._ahead = None
        self.publication.flush()
        self._commit_and_publish(batch, records)

    def _commit_and_publish(self, batch: PendingBatch, records: list[RequestRecord],
                            committed: bool = False) -> None:
        """Previews each row's tokens, commits the Program, then the previews, and queues their
        deltas for publication. `committed`: the Program committed the round already, one
        token a row (a round ahead, `_chain`), which the previews must agree with."""
        check_rows(batch, records)
        start = time.monotonic()
        batch.tokens  # noqa: B018 - waits for the round's step: counted apart from host work
        now = time.monotonic()
        self.rounds.counted(wait_s=now - start)
        k, limits, bare = self.rounds.landed(batch)
        previews, accepted = preview_rows(batch, records, committed)
        if batch.kind is BatchKind.DECODE:
            self.rounds.policy.round_done(k, len(records), now, sum(accepted), bare)
        else:
            self.rounds.policy.interrupt()
        if not committed:
            self.program.commit(batch, accepted)  # Program state first; a failure publishes none
        if batch.kind is BatchKind.PREFILL and accepted[0] > 0 and \
                self.retention.prompt_kept_at_end(records[0]):
            self.retention.retain(records[0])  # the prompt's frontier
        for row, (r, preview, n) in enumerate(zip(records, previews, accepted)):
            r.control = ()
            if preview is None:
                self._terminal(r, FinishReason.CANCELLED)
                continue
            if batch.kind is BatchKind.DECODE and k:
                self.rounds.policy.add_row(r.acceptance, k, limits[row],
                                           int(batch.produced[row]), n)
            n = preview.num_accepted  # the forced tokens too: they are output
            r.completion_tokens += n
            self._generated += n
            self.publication.queue(r, preview, batch, row)  # after the next round starts
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
            elif forced := r.grammar_forced(self.limits.prefill_chunk - 1):
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
        self.rounds.policy.take_samples()  # the stats published with Finished time its rounds
        usage = Usage(r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.reasoning_tokens)
        self.publication.finish(r, Finished(r.request_id, reason, usage, error, r.stop_string))

    def _fail(self, message: str, closing: bool = False) -> None:
        """Ends everything (DESIGN §8): Program's pending work, active state, RM, responses."""
        with self._lock:  # after this no submit can reach the inbox
            self._available = False
            self._failure = message
        self._ahead = None
        self.rounds.clear()
        pending = self.program.pending
        if pending is not None and not pending.consumed:
            _best_effort(self.program.abort_pending, pending)
        for handle in self.program.handles():
            _best_effort(self.program.release, handle)
        for r in self._active:
            r.seq = r.materialized = None  # released above: no result is adopted any more
            _best_effort(self.retention.abort_reload, r)
            r.txn = None  # the ResourceManager's clear ends it
        # A clean close still stores what it retained where that outlives the process (a
        # host-memory tier does not: exporting to it would only delay the exit).
        keep = closing and self.tiers is not None and self.tiers.outlives_process
        for entry in self.catalog.entries():
            _best_effort(self.retention.drop, entry, False, keep)
        self.resources.clear()
        error = message if closing else f"engine_failed: {message}"
        for r in self._active + list(self.scheduler.waiting) + _drained(self._inbox):
            if r.state is not S.FINISHED:
                self._finish(r, FinishReason.ERROR, error, force=True)
        self._active.clear()
        self.scheduler.waiting.clear()
        self.publication.refresh_stats()

    def _snapshot(self) -> EngineStats:
        ps = self.program.stats()
        with self._lock:
            outstanding, available = self._outstanding, self._available
        return EngineStats(
            available=available, waiting=len(self.scheduler.waiting), active=len(self._active),
            outstanding=outstanding, capacity=self.config.max_queue,
            free_lanes=self.resources.num_free(), total_lanes=len(self.resources.lanes),
            free_pages=ps.free_pages, total_pages=ps.total_pages,
            reserved_pages=ps.reserved_pages, free_slots=ps.free_slots,
            total_slots=ps.total_slots, generated_tokens=self._generated,
            finished_requests=self._finished, backfilled=self.admission.backfilled,
            prefix=self.catalog.stats(*self.program.checkpoint_footprint()),
            speculative=self.rounds.policy.stats(ps.bare_rounds),
            transactions=self.resources.transactions.stats(),
            tiers=self.tiers.stats() if self.tiers is not None else TierStats(()),
            rounds=self.rounds.stats())


def _drained(q: queue.SimpleQueue) -> list:
    out = []
    while True:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            return out


def _best_effort(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # cleanup after a failure must reach every request
        log.exception("cleanup step %s failed", getattr(fn, "__name__", fn))

