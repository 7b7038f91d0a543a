"""How many drafts a speculative decode round makes: the K that commits the most tokens per
second for the round's rows, from what this Engine measured.

Owns, on the worker thread: the wall time of a decode round per (K, B) (from one decode
round's output to the next one's, when both had that K and B and nothing else ran between
them: what the user's stream sees, host work and overlap included), the tokens rounds
committed, the acceptance of each draft position (global, decayed, and per request), the choice
of K and the counts behind `SpeculativeStats`.

    k = policy.choose(rows, ready)          # rows: one RowOutlook each
    policy.dispatched(k, rows)              # the Program runs the round of k drafts
    policy.round_done(k, len(rows), now, tokens)  # its output read (interrupt(): other units)
    policy.add_row(acceptance, k, limit, produced, committed)

The choice: the K of most committed tokens per second at the round's B, tokens / t(K, B).
- t: the median time of the last steady rounds of that (K, B) (a change and an executable's
  first runs are not samples); at a B where some K was measured and this one not, its time at
  the nearest B scaled by the ratio of a K measured at both.
- tokens: the mean of that (K, B)'s recent rounds (decayed as the acceptance counts) on
  MODEL_WEIGHT rounds of a model: a row with acceptance a_i (the chance draft i is right when
  drafts 0..i-1 were) and a limit of L tokens expects E(K) = 1 + sum_{j=1..min(K, L-1)}
  prod_{i<j} a_i from a round of K. (The model alone mispredicted rounds of 3 drafts at B = 4
  by about 1.5x on the demo model; the measured mean corrects it.) A request's acceptance is
  its own counts on PRIOR_WEIGHT rounds of the global rate; a position's global rate starts
  from SHRINK rows of the one before it (0.5 at the first) and is read OPTIMISM standard
  errors up.
- The first rounds explore every compiled K, largest first, until each has MIN_SAMPLES steady
  rounds; a new B measures its cheapest K first. Then probes, two rounds each of the largest K
  (acceptance at every position) or of the K whose time is the oldest, keep the estimates
  current, spaced so they add at most PROBE_BUDGET of the time (a probe that costs 3 rounds of
  the chosen K waits about 250 rounds).
- Rows of requests with speculative="off" expect one token at every K; a round of only such
  rows is a round of 0. Only compiled Ks are chosen.

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
WARM_ROUNDS = 2  # steady rounds of a (K, B) not measured, the first time it runs
WINDOW = 9  # the rounds a (K, B)'s time is the median of
MODEL_WEIGHT = 8.0  # rounds of the acceptance model's expectation that estimate starts from
REFRESH = 8  # rounds a choice stands while its rows stay the same (its arithmetic is host time)
PROBE_EVERY = 32  # the fewest rounds at a B between probes
PROBE_BUDGET = 0.02  # the most of the time probes may add (a costlier probe waits longer)
PRIOR_WEIGHT = 4.0  # rounds of the global acceptance a request's own counts start from
# The acceptance counts' weight on the past, per round: about the last 100 rounds count, so an
# estimate that stopped getting counts (its K not chosen) grows uncertain, its upper bound
# rises and the policy tries that K again. Applied every DECAY_EVERY rounds.
DECAY = 0.99
DECAY_EVERY = 16
UNMEASURED = 0.5  # acceptance assumed at a position nobody measured
SHRINK = 2.0  # rows of the position before that a position's global rate starts from
OPTIMISM = 1.0  # standard errors added to a global rate (an upper confidence bound)


class RowAcceptance:
    """One request's accepted / attempted drafts by position (conditional: attempted when
    every draft before it was accepted), decayed as the global counts are."""

    def __init__(self, positions: int):
        self.attempted = [0.0] * positions
        self.accepted = [0.0] * positions

    def decay(self, factor: float) -> None:
        self.attempted = [x * factor for x in self.attempted]
        self.accepted = [x * factor for x in self.accepted]


@dataclasses.dataclass(frozen=True)
class RowOutlook:
    """What the policy knows of a row for the next round."""

    acceptance: RowAcceptance | None  # None: the request speculates nothing ("off", a mask)
    budget: int  # the most tokens the row may commit this round (its max_new_tokens left, cap)


@dataclasses.dataclass(frozen=True)
class _Choice:
    rows: tuple  # the rows' requests (ids of their RowAcceptance)
    round: int  # the round it was made
    ks: list[int]  # the Ks it chose among
    best: int
    gain: float  # best's expected tokens per second over a round of 0's
    probe: int  # the next probe's K
    wait: float  # rounds at this B before it


class DraftPolicy:
    """Chooses each decode round's K among `round_drafts` (one of them: a fixed K) and counts
    what happened. Only the Engine's worker thread touches it."""

    def __init__(self, round_drafts: Sequence[int], method: str):
        self.ks = tuple(round_drafts)
        self.kmax = self.ks[-1]
        self.method = method
        self.adaptive = len(self.ks) > 1
        self._times: dict[tuple[int, int], collections.deque] = {}  # (K, B) -> seconds
        self._median: dict[tuple[int, int], float] = {}  # (K, B) -> their median
        # (K, B) -> [tokens rounds committed, rounds], decayed as the acceptance counts
        self._tokens_seen: dict[tuple[int, int], list[float]] = {}
        self._measured: dict[tuple[int, int], int] = {}  # (K, B) -> the round of its last
        self._warm: collections.Counter = collections.Counter()  # (K, B) -> steady rounds
        self._ready: set[tuple[int, int]] = set()  # (K, B) whose executable is compiled
        self._attempted = [0.0] * self.kmax  # decayed, all requests
        self._accepted = [0.0] * self.kmax
        self._round = 0  # decode rounds dispatched
        self._since_probe: collections.Counter = collections.Counter()  # B -> rounds
        self._probes: collections.Counter = collections.Counter()  # B -> probes made
        self._plan: dict[int, int] = {}  # B -> the K of a probe's second round
        self._choice: dict[int, _Choice] = {}  # B -> the last choice
        self._last: tuple[int, int, float] | None = None  # (K, B, time) of the last round
        self.rounds_by_k: collections.Counter = collections.Counter()
        self.rows = 0  # rows of rounds with drafts that committed tokens
        self.tokens = 0  # tokens they committed
        self._cum_attempted = [0] * self.kmax  # per position: the row's limit allowed it
        self._cum_accepted = [0] * self.kmax  # and drafts 0..i were all accepted
        self._gain = [0.0, 0]  # sum of estimated gains of chosen K over K = 0, rounds

    # The choice ----------------------------------------------------------------------------
    def choose(self, rows: Sequence[RowOutlook], ready: Callable[[int, int], bool]) -> int:
        """The round's K for `rows` (B = len(rows)), without changing the policy (it may be
        asked again before the round is dispatched). `ready(k, b)`: whether that round's
        executable is compiled (one that is not is never waited for, the largest aside)."""
        b = len(rows)
        if not self.adaptive:
            return self.kmax
        ks = [k for k in self.ks if (k, b) in self._ready or self._check_ready(k, b, ready)]
        if len(ks) == 1:  # the others still compiling
            return ks[0]
        if all(r.acceptance is None or r.budget <= 1 for r in rows):
            return ks[0]  # nothing to draft: the cheapest round
        if self._plan.get(b) in ks:
            return self._plan[b]
        if not any(self._known(k, b) for k in ks) and any(
                self._known(*key) for key in self._median if key[1] != b):
            return ks[0]  # a new B: its cheapest round's time scales the others'
        for k in reversed(ks):  # explore: the largest first, the Program's fixed choice
            if self._time(k, b) is None:
                return k
        made = self._choice_for(rows, ks)
        return made.probe if self._since_probe[b] >= made.wait else made.best

    def _check_ready(self, k: int, b: int, ready: Callable[[int, int], bool]) -> bool:
        """Whether a round of K at B may run now (the largest always: it is waited for);
        remembered once true (an executable stays compiled)."""
        if k == self.kmax or ready(k, b):
            self._ready.add((k, b))
            return True
        return False

    def _choice_for(self, rows: Sequence[RowOutlook], ks: list[int]) -> _Choice:
        """The K of most expected tokens per second for these rows and the next probe
        (recomputed when the rows change, after a probe, else every REFRESH rounds)."""
        b = len(rows)
        key = tuple(id(r.acceptance) for r in rows)
        made = self._choice.get(b)
        if made is not None and made.rows == key and self._round - made.round < REFRESH \
                and made.ks == ks:
            return made
        hopeful = self._global_rates()
        rates = [self._rates(r.acceptance, hopeful) for r in rows]
        times = {k: self._time(k, b) for k in ks}
        scores = {k: self._tokens(k, b, self._expected(rows, rates, k)) / times[k] for k in ks}
        best = max(ks, key=lambda k: (scores[k], -k))
        probe = self._probe(best, b, ks)
        # two rounds of the probe's K (the second measures its time) and a change each way
        # (about a round of the best) may add at most PROBE_BUDGET of the time
        extra = 2.0 * max(times[probe] / times[best] - 1.0, 0.0) + 1.0
        made = self._choice[b] = _Choice(key, self._round, ks, best, scores[best] / scores[ks[0]],
                                         probe, max(PROBE_EVERY, extra / PROBE_BUDGET))
        return made

    def _probe(self, best: int, b: int, ks: list[int]) -> int:
        """The next probe's K: every other probe the largest (every position's acceptance at
        once; when that is the best, the K below it), the others the K whose time is the
        oldest (no estimate stays from a cold start or a busy moment)."""
        others = [k for k in ks if k != best]
        if self._probes[b] % 2 == 0:
            return others[-1]
        return min(others, key=lambda k: self._measured.get((k, b), -1))

    def dispatched(self, k: int, rows: Sequence[RowOutlook]) -> None:
        """Counts a round of K (the one `choose` gave, or the largest for a fixed policy)."""
        self.rounds_by_k[k] += 1
        if not self.adaptive:
            return
        b = len(rows)
        self._round += 1
        if self._round % DECAY_EVERY == 0:
            self._decay(rows)
        made = self._choice.get(b)
        if made is not None and made.best == k:
            self._gain[0] += made.gain
            self._gain[1] += 1
        self._since_probe[b] += 1
        if self._plan.get(b) == k:  # a probe's second round
            del self._plan[b]
        elif made is not None and k == made.probe and k != made.best \
                and self._since_probe[b] > made.wait:  # a probe's first round
            self._plan[b] = k
            self._probes[b] += 1
            self._since_probe[b] = 0
            del self._choice[b]  # the next probe is another

    def _decay(self, rows: Sequence[RowOutlook]) -> None:
        factor = DECAY**DECAY_EVERY
        self._attempted = [x * factor for x in self._attempted]
        self._accepted = [x * factor for x in self._accepted]
        for seen in self._tokens_seen.values():
            seen[0] *= factor
            seen[1] *= factor
        for r in rows:
            if r.acceptance is not None:
                r.acceptance.decay(factor)

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

    def _tokens(self, k: int, b: int, model: float) -> float:
        """The tokens a round of K commits at B: the recent rounds' mean (decayed), on
        MODEL_WEIGHT rounds of the acceptance model's expectation for the rows at hand."""
        total, rounds = self._tokens_seen.get((k, b), (0.0, 0.0))
        return (total + MODEL_WEIGHT * model) / (rounds + MODEL_WEIGHT)

    def _known(self, k: int, b: int) -> bool:
        return len(self._times.get((k, b), ())) >= MIN_SAMPLES

    def _time(self, k: int, b: int) -> float | None:
        """A round's seconds: measured at this B, else the time of a K measured here scaled
        by the two's ratio at the nearest B where both were (None: no estimate)."""
        if self._known(k, b):
            return max(self._median[(k, b)], 1e-9)
        pairs = [(abs(other - b), self._median[(ref, b)] * self._median[(k, other)]
                  / max(self._median[(ref, other)], 1e-9))
                 for (kk, other) in self._median if kk == k and self._known(k, other)
                 for ref in self.ks if self._known(ref, b) and self._known(ref, other)]
        return max(min(pairs)[1], 1e-9) if pairs else None

    # What happened -------------------------------------------------------------------------
    def round_done(self, k: int, b: int, now: float, tokens: int) -> None:
        """A decode round of K drafts and B rows whose output was read at `now` (monotonic
        seconds) committed `tokens`; the time since the last one is its time when that one had
        the same K and B (and tokens / time its rate). The
        first round after a change is not a sample: it carries the change (a round chained
        ahead lands, or the first round of 0 is not chained yet), which steady rounds do not;
        nor are the first WARM_ROUNDS steady ones of a (K, B) (an executable's first runs
        are slower)."""
        seen = self._tokens_seen.setdefault((k, b), [0.0, 0.0])
        seen[0] += tokens
        seen[1] += 1.0
        if self._last is not None and self._last[:2] == (k, b):
            if self._warm[(k, b)] >= WARM_ROUNDS:
                seconds = max(now - self._last[2], 1e-9)
                times = self._times.setdefault((k, b), collections.deque(maxlen=WINDOW))
                times.append(seconds)
                self._median[(k, b)] = statistics.median(times)

                self._measured[(k, b)] = self._round
            self._warm[(k, b)] += 1
        self._last = (k, b, now)

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
