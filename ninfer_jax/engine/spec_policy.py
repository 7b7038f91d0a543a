"""How many drafts a speculative decode round makes: the K that commits the most tokens per
second for the round's rows, from what this Engine measured.

Owns, on the worker thread: the wall time of a decode round per (K, B) (the time from one
decode round's output to the next one's, when nothing else ran between them: what the user's
stream sees, host work and overlap included), the acceptance of each draft position (global,
decayed, and per request), the choice of K and the counts behind `SpeculativeStats`.

    k = policy.choose(rows, ready)          # rows: one RowOutlook each
    ... the Program runs the round of k drafts; its output is processed ...
    policy.round_done(k, len(rows), now)    # or policy.interrupt() after any other unit
    policy.add_row(acceptance, k, limit, produced)

The choice: a row with acceptance a_i (the chance draft i is right when drafts 0..i-1 were)
and a limit of L tokens expects E(K) = 1 + sum_{j=1..min(K, L-1)} prod_{i<j} a_i tokens from a
round of K; the policy picks argmax_K sum_rows E(K) / t(K, B), t the median of the last
measured rounds. A (K, B) measured fewer than MIN_SAMPLES times is run first (the Engine's
first rounds at each B explore every compiled K); while a K below the largest is chosen, one
round in PROBE_EVERY or more drafts the largest K, so acceptance at every position and the time
of larger K stay current (spaced so that probes add at most PROBE_BUDGET of the time: one that
costs 3 rounds of the chosen K waits 100 rounds).
A request's acceptance is its own counts with PRIOR_WEIGHT rounds of the global rate; a
position's global rate starts from SHRINK rows of the one before it (0.5 at the first), and
the choice reads it OPTIMISM standard errors up. Rows of requests with
speculative="off" expect one token at every K; a round of only such rows is a round of 0.

Does not own: which K values exist (`ProgramConfig.round_drafts`, compiled at start), the
rows' limits (the Program clips them to K + 1), or exactness (every K gives the same greedy
tokens and the same sampled distribution: `program/speculative.py`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence

MIN_SAMPLES = 3  # measured rounds of a (K, B) before the policy trusts its time
WINDOW = 9  # the rounds a (K, B)'s time is the median of
PROBE_EVERY = 32  # the fewest rounds at a B between probes of the largest K
PROBE_BUDGET = 0.02  # the most of the time probes may add (a costlier probe waits longer)
PRIOR_WEIGHT = 4.0  # rounds of the global acceptance a request's own counts start from
# The acceptance counts' weight on the past, per round: about the last 100 rounds count, so an
# estimate that stopped getting counts (its K not chosen) grows uncertain, its upper bound
# rises and the policy tries that K again.
DECAY = 0.99
UNMEASURED = 0.5  # acceptance assumed at a position nobody measured
SHRINK = 2.0  # rows of the position before that a position's global rate starts from
OPTIMISM = 1.0  # standard errors added to a global rate (an upper confidence bound)


class RowAcceptance:
    """One request's accepted / attempted drafts by position (conditional: attempted when
    every draft before it was accepted), decayed by DECAY a round."""

    def __init__(self, positions: int):
        self.attempted = [0.0] * positions
        self.accepted = [0.0] * positions

    def decay(self) -> None:
        self.attempted = [x * DECAY for x in self.attempted]
        self.accepted = [x * DECAY for x in self.accepted]


@dataclasses.dataclass(frozen=True)
class RowOutlook:
    """What the policy knows of a row for the next round."""

    acceptance: RowAcceptance | None  # None: the request speculates nothing ("off", a mask)
    budget: int  # the most tokens the row may commit this round (its max_new_tokens left, cap)


class DraftPolicy:
    """Chooses each decode round's K among `round_drafts` (`adaptive`; else always the
    largest) and counts what happened. Only the Engine's worker thread touches it."""

    def __init__(self, round_drafts: Sequence[int], method: str, adaptive: bool):
        self.ks = tuple(round_drafts)
        self.kmax = self.ks[-1]
        self.method = method
        self.adaptive = adaptive and len(self.ks) > 1
        self._times: dict[tuple[int, int], collections.deque] = {}  # (K, B) -> seconds
        self._median: dict[tuple[int, int], float] = {}  # (K, B) -> their median
        self._attempted = [0.0] * self.kmax  # decayed, all requests
        self._accepted = [0.0] * self.kmax
        self._since_probe: collections.Counter = collections.Counter()  # B -> rounds
        self._best: dict[int, int] = {}  # B -> the K the last choice found best
        self._last: tuple[int, float] | None = None  # (B, time) of the last decode round
        self.rounds_by_k: collections.Counter = collections.Counter()
        self.rows = 0  # rows of rounds with drafts that committed tokens
        self.tokens = 0  # tokens they committed
        self._cum_attempted = [0] * self.kmax  # per position: the row's limit allowed it
        self._cum_accepted = [0] * self.kmax  # and drafts 0..i were all accepted
        self._gain = [0.0, 0]  # sum of estimated gains of chosen K over K = 0, rounds
        self._scores: tuple[int, dict] = (0, {})  # (B, expected tokens/s by K) of the choice

    # The choice ----------------------------------------------------------------------------
    def choose(self, rows: Sequence[RowOutlook], ready: Callable[[int, int], bool]) -> int:
        """The round's K for `rows` (B = len(rows)). `ready(k, b)`: whether that round's
        executable is compiled (one that is not is never waited for, the largest aside)."""
        b = len(rows)
        if not self.adaptive:
            return self.kmax
        ks = [k for k in self.ks if k == self.kmax or ready(k, b)]
        if all(r.acceptance is None or r.budget <= 1 for r in rows):
            return ks[0]  # nothing to draft: the cheapest round
        for k in reversed(ks):  # explore: the largest first, the Program's fixed choice
            if len(self._times.get((k, b), ())) < MIN_SAMPLES:
                return k
        hopeful = self._global_rates()
        rates = [self._rates(r.acceptance, hopeful) for r in rows]
        scores = {k: self._expected(rows, rates, k) / self._time(k, b) for k in ks}
        best = self._best[b] = max(ks, key=lambda k: (scores[k], -k))
        self._scores = (b, scores)
        if best != ks[-1]:
            probe = ks[-1]  # every position's acceptance at once
            extra = max(self._time(probe, b) / self._time(best, b) - 1.0, 0.0)
            if self._since_probe[b] >= max(PROBE_EVERY, extra / PROBE_BUDGET):
                return probe
        return best

    def dispatched(self, k: int, rows: Sequence[RowOutlook]) -> None:
        """Counts a round of K (the one `choose` gave, or the largest for a fixed policy)."""
        self.rounds_by_k[k] += 1
        if not self.adaptive:
            return
        b = len(rows)
        self._attempted = [x * DECAY for x in self._attempted]
        self._accepted = [x * DECAY for x in self._accepted]
        for r in rows:
            if r.acceptance is not None:
                r.acceptance.decay()
        chosen_at, scores = self._scores
        if chosen_at == b and 0 in scores and k in scores:
            self._gain[0] += scores[k] / scores[0]
            self._gain[1] += 1
        self._scores = (0, {})
        probed = k > self._best.get(b, k)
        self._since_probe[b] = 0 if probed else self._since_probe[b] + 1

    def _expected(self, rows: Sequence[RowOutlook], rates: list, k: int) -> float:
        total = 0.0
        for row, a in zip(rows, rates):
            total += 1.0
            if row.acceptance is None:
                continue
            p = 1.0
            for j in range(min(k, row.budget - 1)):
                p *= a[j]
                total += p
        return total

    def _global_rates(self) -> list[float]:
        """Per position, the chance that draft i is right given drafts 0..i-1 were, over all
        requests: the counts shrunk toward the position before (few samples reach deep
        positions) plus OPTIMISM standard errors (an estimate that a few unlucky rounds pushed
        below the break-even would otherwise freeze there: a K not chosen yields no counts)."""
        rates, prior = [], UNMEASURED
        for i in range(self.kmax):
            n = self._attempted[i] + SHRINK
            prior = (self._accepted[i] + SHRINK * prior) / n
            rates.append(min(1.0, prior + OPTIMISM * math.sqrt(prior * (1.0 - prior) / n)))
        return rates

    @staticmethod
    def _rates(own: RowAcceptance | None, hopeful: list[float]) -> list[float]:
        """A request's rates: its own counts on PRIOR_WEIGHT rounds of the global ones."""
        if own is None:
            return hopeful
        return [(acc + PRIOR_WEIGHT * g) / (att + PRIOR_WEIGHT)
                for acc, att, g in zip(own.accepted, own.attempted, hopeful)]

    def _time(self, k: int, b: int) -> float:
        return max(self._median[(k, b)], 1e-9)

    # What happened -------------------------------------------------------------------------
    def round_done(self, k: int, b: int, now: float) -> None:
        """A decode round of K drafts and B rows was processed at `now` (monotonic seconds);
        the time since the last one is its time when that one had the same rows' count."""
        if self._last is not None and self._last[0] == b:
            times = self._times.setdefault((k, b), collections.deque(maxlen=WINDOW))
            times.append(now - self._last[1])
            self._median[(k, b)] = statistics.median(times)
        self._last = (b, now)

    def interrupt(self) -> None:
        """Something other than a decode round ran: the next round's time is not a round's."""
        self._last = None

    def add_row(self, acceptance: RowAcceptance | None, k: int, limit: int,
                produced: int, committed: int) -> None:
        """A row of a round of K drafts that proposed `produced` tokens (its limit `limit`),
        `committed` of them kept; `acceptance`: its request's (None: it drafts nothing)."""
        if k == 0 or acceptance is None:
            return
        self.rows += 1
        self.tokens += committed
        for i in range(min(k, limit - 1)):
            self._cum_attempted[i] += 1
            self._cum_accepted[i] += produced > i + 1
        for i in range(min(k, limit - 1, produced)):  # reached: drafts 0..i-1 were right
            right = produced > i + 1
            self._attempted[i] += 1.0
            self._accepted[i] += right
            acceptance.attempted[i] += 1
            acceptance.accepted[i] += right

    def stats(self):
        from ninfer_jax.engine.spec_stats import SpeculativeStats

        cum = tuple(a / n if n else 0.0 for a, n in zip(self._cum_accepted,
                                                         self._cum_attempted))
        times = tuple(sorted((k, b, round(1e3 * t, 3)) for (k, b), t in self._median.items()))
        return SpeculativeStats(
            method=self.method, num_speculative_tokens=self.kmax, verify_rows=self.rows,
            committed_tokens=self.tokens,
            mean_accepted_tokens=self.tokens / self.rows if self.rows else 0.0,
            acceptance_by_position=cum, policy="adaptive" if self.adaptive else "fixed",
            rounds_by_drafts=tuple(sorted(self.rounds_by_k.items())),
            estimated_gain=self._gain[0] / self._gain[1] if self._gain[1] else 0.0,
            round_ms=times)
