"""Publication: what each request's consumer sees, and in what order (DESIGN §6).

Owns every request's EventSink and CapacityToken, the committed round output not yet turned
into deltas, and the EngineStats snapshot that other threads read. The worker alone publishes;
`open` is the one call from a submitting thread (under the EngineCore's submission lock).

The order it keeps:
- A round's deltas go out only after its Program commit (the caller queues them after it) and
  after the terminal result of a request that ended is adopted (`adopt_terminal`, the
  EngineCore's: its turn checkpoint is retained before the client reads its last delta).
- Committed output goes out before any other event of any request: nothing overtakes a delta.
- The stats snapshot is replaced before the events it accounts for: a consumer that has read a
  delta or Finished reads stats that count it.
- Finished gives the request's capacity back before it is published, so a consumer that read
  it may submit again without a spurious overload.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ninfer_jax.engine.events import (
    Channel,
    Delta,
    Event,
    Finished,
    InvariantError,
    TokenLogprob,
)
from ninfer_jax.engine.handle import CapacityToken, EventSink
from ninfer_jax.engine.request import RequestRecord, RequestState
from ninfer_jax.engine.stats import EngineStats

if TYPE_CHECKING:
    from ninfer_jax.frontend.output_session import Preview
    from ninfer_jax.program.pending import PendingBatch


class Publication:
    def __init__(self, snapshot: Callable[[], EngineStats],
                 adopt_terminal: Callable[[RequestRecord], None]):
        """`snapshot` builds the worker's stats; `adopt_terminal` adopts an ended request's
        terminal resource result (once; a no-op after)."""
        self._snapshot, self._adopt_terminal = snapshot, adopt_terminal
        self._sinks: dict[int, EventSink] = {}
        self._capacity: dict[int, CapacityToken] = {}
        # Committed round output (record, Frontend preview, log-probs) not yet published: it
        # goes out while the next round computes, or before anything else is published.
        self._committed: list[tuple[RequestRecord, Preview, tuple[TokenLogprob, ...] | None]] \
            = []
        self.stats = snapshot()

    def open(self, request_id: int, sink: EventSink, capacity: CapacityToken) -> None:
        """A request's sink and capacity token, from its submission to its Finished."""
        self._sinks[request_id] = sink
        self._capacity[request_id] = capacity

    def refresh_stats(self) -> None:
        self.stats = self._snapshot()

    # Committed output ------------------------------------------------------------------------
    def queue(self, r: RequestRecord, preview: Preview, batch: PendingBatch, row: int) -> None:
        """A row's committed round output (its Program commit done), to go out next, with its
        log-probs when the request asked for them."""
        logprobs = None
        if r.sampling.logprobs is not None:
            forced = batch.forced  # forced control: no draw, reported as certain
            logprobs = tuple(TokenLogprob(t, 0.0) for t in preview.token_ids[:len(forced)])
            logprobs += tuple(
                TokenLogprob(t, lp, top[: r.sampling.logprobs]) for t, (lp, top) in
                zip(preview.token_ids[len(forced):], batch.row_logprobs(row)))
        self._committed.append((r, preview, logprobs))

    def queued_previews(self) -> dict[int, Preview]:
        """Each request's committed preview not yet published (its session has not seen it)."""
        return {r.request_id: p for r, p, _ in self._committed}

    def flush(self) -> None:
        """Commits the Frontend previews of committed rounds and publishes their deltas, in
        order."""
        if self._committed:
            self.refresh_stats()  # first: stats read after a delta count its tokens
        while self._committed:
            r, preview, logprobs = self._committed.pop(0)
            if r.state is RequestState.TERMINAL_PENDING:
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

    # Other events ----------------------------------------------------------------------------
    def publish(self, r: RequestRecord, event: Event) -> None:
        self.flush()  # committed output first: nothing overtakes a delta
        self._emit(r, event)

    def finish(self, r: RequestRecord, event: Finished) -> None:
        """A request's last event: its capacity back first, then fresh stats, then Finished."""
        self._capacity.pop(r.request_id).response_done()
        self.refresh_stats()  # stats read after Finished count the request
        self.publish(r, event)
        self._sinks.pop(r.request_id, None)

    def _emit(self, r: RequestRecord, event: Event) -> None:
        sink = self._sinks.get(r.request_id)
        if sink is not None:
            sink.put(event)


def check_rows(batch: PendingBatch, records: list[RequestRecord]) -> None:
    """A round's output is read for exactly the rows it was dispatched for, in order."""
    if [r.seq for r in records] != list(batch.handles):
        raise InvariantError(f"PendingBatch membership {batch.handles} != round {records}")


def preview_rows(batch: PendingBatch, records: list[RequestRecord], committed: bool
                 ) -> tuple[list[Preview | None], list[int]]:
    """Each row's Frontend preview of its round's tokens (forced control's first) and the
    sampled tokens it accepts: what the Program commits. A row cancelled while the round
    computed accepts nothing (None: no preview), unless the round was `committed` ahead (one
    token a row, which every preview must accept)."""
    previews, accepted = [], []
    for row, r in enumerate(records):
        if not committed and r.cancel_requested.is_set():
            previews.append(None)
            accepted.append(0)
            continue
        forced = list(batch.forced)
        tokens = forced + batch.row_tokens(row)  # never past the budget
        budget_ends = r.completion_tokens + len(tokens) >= r.sampling.max_new_tokens
        preview = r.session.preview(tokens, budget_ends=budget_ends, forced=len(forced))
        if preview.num_accepted <= len(forced):
            raise InvariantError(f"request {r.request_id}: a preview accepted no sampled token")
        previews.append(preview)
        accepted.append(preview.num_accepted - len(forced))
    if committed and accepted != [1] * len(records):
        raise InvariantError(f"a round committed ahead with one token a row previewed {accepted}")
    return previews, accepted
