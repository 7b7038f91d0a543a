"""Rounds: what each decode round asks of the Program, and what the worker spent on rounds.

Worker-owned. Plans a decode round's inputs from its rows (`plan`: the number of drafts K the
draft policy chooses, each row's cap and grammar mask), remembers the rows' limits of every
round in flight until its output is read (`landed`), feeds the draft policy what each round
measured, and counts the rounds and the worker's host time behind `RoundStats`. Which rows run
and when is the Scheduler's and the EngineCore's; the choice of K is `spec_policy.DraftPolicy`'s.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ninfer_jax.engine.request import RequestRecord
from ninfer_jax.engine.spec_policy import DraftPolicy, RowAcceptance, RowOutlook
from ninfer_jax.engine.stats import RoundStats

if TYPE_CHECKING:
    from ninfer_jax.frontend.output_session import Preview
    from ninfer_jax.program.limits import ProgramLimits
    from ninfer_jax.program.pending import PendingBatch

Ready = Callable[[int, int], bool]  # (drafts, batch) -> that round's executable is compiled
Stale = Callable[[Any], int]  # a sequence handle -> `HostProgram.context_stale`


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """One decode round's inputs for `HostProgram.decode`."""

    drafts: int  # K
    outlooks: list[RowOutlook]  # one a row, for the draft policy
    caps: list[int] | None = None  # tokens each row may produce; None: no row has a cap
    masks: list[np.ndarray | None] | None = None  # allowed-token bitmasks; None: none has one
    bare: bool = False  # a round of 0 that may skip the drafter's upkeep


class Rounds:
    def __init__(self, limits: ProgramLimits):
        self.policy = DraftPolicy(limits.round_drafts, limits.speculative,
                                  limits.context_window)
        self._positions = limits.verify_width - 1  # draft positions a row's acceptance counts
        # batch id -> (K, row limits or None, bare): rounds that draft, and bare rounds of 0
        self._in_flight: dict[int, tuple[int, list[int] | None, bool]] = {}
        # A bare round of 0 chained for these rows, and the rounds after it the policy holds
        # to the same (`DraftPolicy.holds`; None: not asked yet, until it is dispatched)
        self._held: tuple[list[RequestRecord], RoundPlan] | None = None
        self._holds: int | None = 0
        self._rounds = self._rows = 0
        self._host_s = self._wait_s = 0.0

    def plan(self, records: Sequence[RequestRecord], queued: dict[int, Preview],
             ready: Ready, refill: bool = False, stale: Stale | None = None,
             filling: bool = False) -> RoundPlan:
        """The next decode round of these rows. A row may not run past the point where its
        Frontend will force control (counting `queued`: its committed round not yet published
        to its session); grammar rows get the mask of their next token (the matcher is at the
        committed output) and, like rows of requests with speculative="off", draft nothing.
        `refill`: requests are waiting for a row (the draft policy's objective). `stale`:
        rounds until a row's drafter context is whole (None: always). `filling`: a waiting
        request may be admitted next (`Admission.filling`)."""
        self._held = None
        caps = [r.session.tokens_before_control(queued.get(r.request_id)) for r in records]
        masks = [r.next_mask() for r in records]
        outlooks = []
        for r, cap, mask in zip(records, caps, masks):
            budget = r.sampling.max_new_tokens - r.completion_tokens
            budget = budget if cap is None else min(budget, cap)
            drafts = mask is None and r.sampling.speculative == "on"
            if drafts and r.acceptance is None:
                r.acceptance = RowAcceptance(self._positions)
            outlooks.append(RowOutlook(r.acceptance if drafts else None, budget))
        outlooks, k = self._choose(records, outlooks, ready, refill, filling, stale)
        if k:  # rows that draft nothing propose one token
            caps = [o.budget if o.acceptance is not None else 1 for o in outlooks]
        return RoundPlan(k, outlooks, None if all(c is None for c in caps) else caps,
                         None if all(m is None for m in masks) else masks,
                         bare=not k and self.policy.bare(outlooks, refill))

    def chain_plan(self, records: Sequence[RequestRecord], ready: Ready,
                   refill: bool = False, stale: Stale | None = None,
                   filling: bool = False) -> RoundPlan | None:
        """The rows' next round, chained ahead, when it drafts nothing (None: the policy
        would draft). Chainable rows have no control, grammar or thinking budget ahead, so
        their budgets are their tokens left. After a bare round of 0 of the same rows, with
        nothing waiting, the policy's `holds` rounds are bare rounds of 0 without asking it
        (the same plan again: a round of 0 reads only its outlooks' requests)."""
        held = self._held
        if held is not None and self._holds and not refill and len(held[0]) == len(records) \
                and all(a is b for a, b in zip(held[0], records)):
            self._holds -= 1
            return held[1]
        self._held = None
        outlooks = [RowOutlook(r.acceptance if r.sampling.speculative == "on" else None,
                               r.sampling.max_new_tokens - r.completion_tokens)
                    for r in records]
        if self.policy.adaptive:
            outlooks, k = self._choose(records, outlooks, ready, refill, filling, stale)
            if k:
                return None
        plan = RoundPlan(0, outlooks, bare=self.policy.bare(outlooks, refill))
        if plan.bare and not refill:
            self._held, self._holds = (list(records), plan), None
        return plan

    def _choose(self, records: Sequence[RequestRecord], outlooks: list[RowOutlook],
                ready: Ready, refill: bool, filling: bool,
                stale: Stale | None) -> tuple[list[RowOutlook], int]:
        """The policy's K for the rows, and their outlooks. Each row's `RowOutlook.stale`
        (rounds until its drafter context is whole) is asked only for a choice that drafts
        (nothing else reads it), which is made again with it where a row is stale."""
        k = self.policy.choose(outlooks, ready, refill, filling)
        if k and stale is not None and self.policy.window:
            stales = [stale(r.seq) for r in records]
            if any(stales):
                outlooks = [o._replace(stale=n) for o, n in zip(outlooks, stales)]
                k = self.policy.choose(outlooks, ready, refill, filling)
        return outlooks, k

    def dispatched(self, batch: PendingBatch, k: int, outlooks: list[RowOutlook],
                   bare: bool = False) -> None:
        self.policy.dispatched(k, outlooks, bare)
        if self._held is not None and self._holds is None and outlooks is self._held[1].outlooks:
            self._holds = self.policy.holds(len(outlooks))
        if k:  # a round of 0 proposes one token a row
            self._in_flight[batch.batch_id] = (
                k, [1 if o.acceptance is None else max(1, min(k + 1, o.budget))
                    for o in outlooks], False)
        elif bare:
            self._in_flight[batch.batch_id] = (0, None, True)
        self._rounds += 1
        self._rows += len(outlooks)

    def landed(self, batch: PendingBatch) -> tuple[int, list[int] | None, bool]:
        """A round's K, its rows' limits (None for a round of 0) and whether it was a bare
        round of 0, as its output is read."""
        return self._in_flight.pop(batch.batch_id, (0, None, False))

    def dropped(self, batch: PendingBatch) -> None:
        self._in_flight.pop(batch.batch_id, None)

    def clear(self) -> None:
        self._in_flight.clear()
        self._held = None

    def counted(self, *, host_s: float = 0.0, wait_s: float = 0.0) -> None:
        """Worker time of decode iterations: host work, and waiting for a round's tokens."""
        self._host_s += host_s
        self._wait_s += wait_s

    @property
    def wait_s(self) -> float:
        return self._wait_s

    def stats(self) -> RoundStats:
        return RoundStats(self._rounds, self._rows, self._host_s, self._wait_s)


def chainable(records: Sequence[RequestRecord], ahead: bool) -> bool:
    """Whether the next round of these rows may be dispatched before this one's output is
    processed: plain decode rows (a round of no drafts; no grammar or thinking budget: nothing
    the next round needs from this one's text), none cancelled or past its deadline, and
    budget for a token after this round's (`ahead`: this round's is not counted yet)."""
    now = time.monotonic()
    spent = 2 if ahead else 1
    return all(r.grammar is None and r.sampling.max_thinking_tokens is None
               and not r.control and not r.cancel_requested.is_set()
               and (r.deadline is None or now < r.deadline)
               and r.completion_tokens + spent < r.sampling.max_new_tokens
               for r in records)
