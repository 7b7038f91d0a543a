"""How many drafts a speculative decode round makes: the K that commits the most tokens per
second for the round's rows, from what this Engine measured.

Owns, on the worker thread: the wall time of a decode round per (K, B) (from one decode
round's output to the next one's, when both had that K and B and nothing else ran between
them: what the user's stream sees, host work and overlap included), the acceptance of each
draft position (a prior from requests' first rounds, and per request), the choice of K and the
counts behind `SpeculativeStats`.

    k = policy.choose(rows, ready, refill, filling)  # rows: one RowOutlook each
    bare = not k and policy.bare(rows, refill)  # may a round of 0 skip the drafter's upkeep
    policy.dispatched(k, rows, bare)        # the Program runs the round of k drafts
    policy.round_done(k, len(rows), now, tokens, bare)  # its output read (interrupt(): other
                                                       # units)
    policy.add_row(acceptance, k, limit, produced, committed)

The choice: the K of most committed tokens per second for the round's rows.
- t(K, B): the mean of the last steady rounds of that (K, B), each clipped at CLIP times their
  median (a change, the start of a chain of rounds of 0 and an executable's first runs are not
  samples; a drafting round fewer than STINT rounds into a run of its K is counted as a steady one,
  its time divided by how much slower such rounds were than steady ones at that B, or at the
  nearest B that ran a drafting K long enough to tell; a round of 0 with the upkeep fewer than
  STINT_ZERO rounds into its run the same, by such rounds of 0 at that B only); at a B where some K
  was measured and this one not, its time at the nearest B scaled by a K measured at both (the
  larger of their ratio and K's extra over it in proportion to the rows), but a drafting K from a
  smaller B the least it can take (its time there, or the cheapest's here, whichever is longer): a
  K that may win at the new B runs there and is measured (scaled by the rows, the demo's DFlash K =
  8 read ~29 ms at B = 4 where it took ~15, and the policy held rounds of 0 where fixed K = 8 ran
  1.05-1.22x off). Ks are compared on times taken close together: every sample is paired with the
  other Ks' samples of the NEAR rounds before it, and a K other than the anchor (the K of the
  latest sample, mostly the choice) is timed as the anchor's time times their paired ratio (the
  geometric mean of the two directions': a busy stretch of the machine slows both sides of a pair;
  times taken at different moments would compare the stretches, not the Ks). A K with no pairs of
  its own with the anchor (the largest ones, timed in the first exploration only and paired there
  with the K they ran after) is timed through the chain of pairs that links them, once that puts it
  more than BAND from its own time: in a burst of the machine the rounds of 0 slowed 2-3x while
  such a K's time stayed, and the demo's DFlash at B = 1 drafted K = 8 and 15 for 5-14 rounds of a
  turn (three such turns: 0.57-0.76 of off). A drafting choice paired only with rounds of 0 before
  it is checked by rounds of 0 right after its samples.
- Tokens: a row with acceptance a_i (the chance draft i is right when drafts 0..i-1 were) and
  a limit of L tokens expects E(K) = 1 + sum_{j=1..min(K, L-1)} prod_{i<j} a_i from a round
  of K. A request's a_i are its own counts on PRIOR_WEIGHT rounds of an anchor: the prior at
  draft 0, deeper its own rate at the draft before times the prior's ratio of the two. The
  prior counts drafts in requests' first OPENING rounds and in probes (what a request of which
  nothing is known expects: neither comes when the text is predictable; a request that opens
  with rounds of 0 adds only its probes; a position's rate starts from SHRINK rows of the one
  before it, 0.5 at the first) and forgets by rows counted, not by time.
- With requests waiting (`refill`: a row that ends is replaced) the rate is the round's,
  sum E / t(K, B). Else it is the rows' own speed to their ends, as their streams see it (rows
  over the sum of each row's seconds a token) with K kept: row i needs budget_i / E_i rounds,
  and rows that end first leave rounds of fewer rows. Scoring the rows' work to the last
  one's end instead held the demo's DFlash at B = 4 mostly to rounds of 0, where fixed K = 4
  and 8 end three of four requests sooner and the fourth about when it would: their decode
  tok/s 1.18x and 1.28x off's, the turn's tokens per second 0.92x and 0.97x
  (`results/spec_policy_2026-12-07_dflash_w.json`).
- A K that drafts must promise MARGIN more than the cheapest round, and SWITCH more than the
  drafting K of the last round at its B if it is another one. A choice that drafts is
  made again every REFRESH_DRAFTING rounds where it promises 1 + FAR of the cheapest's tokens
  per second or more, else every round (each adds counts; every round too where a row that
  drafts may commit less than a whole round of it); one of the cheapest stands REFRESH rounds
  (REFRESH_FAR where every K that drafts is expected to commit under 1 - FAR of the
  cheapest's tokens per second). The round times `round_done` kept are added to the
  estimates when a choice is scored.
- The first rounds explore every compiled K, largest first, until each has MIN_SAMPLES steady rounds
  (a drafting K, MIN_SAMPLES at least STINT rounds into its run: the process's first rounds and
  those after a change are slower); a new B measures its cheapest K first, and an exploration ends
  only once the cheapest K's time is measured at its B, never scaled (a turn of the demo's DFlash
  that ended amid the exploration at B = 4 left a round of 0 there scaled from B = 1 at 4.9 ms
  against 3.0 measured: K = 3 drafted at ~0.7 of 0's rate for two turns). Then probes keep the
  estimates current: while the cheapest K is the best, of the drafting K of the highest score; else
  of the cheapest K, the largest (acceptance at every position) and the K whose time is the oldest
  in turn; each until its time has a sample (two rounds; of the cheapest K, MIN_SAMPLES samples),
  spaced so they lose at most PROBE_BUDGET of the time (of the rounds with a row that may draft: the
  requests that pay for them; counting every round, requests with speculative="off" taking turns
  with ones that draft in one Engine had the latter probed about twice as often); a probe that
  drafts waits for rows that live through its two rounds (drafts a row's end cuts time K for fewer
  tokens). A probe's loss is measured: the time of its rounds and of the SETTLE rounds of the best
  after it (the change back: a chain of rounds of 0 restarts) less what their tokens take at the
  best's rate, in rounds of the best (the median of the last PROBE_MEMORY probes of that K and B);
  before one is measured, each of its two rounds loses what its tokens would have taken less at the
  best's rate, plus a round for the changes (a K that nearly ties the best is probed often). Where
  every K that drafts is expected to commit under 1 - FAR of the cheapest's tokens per second, a
  probe also costs the `window` rounds of upkeep before it (bare rounds, below; each what rounds of
  0 with the upkeep took more than bare ones at its B, timed where a stretch of one kind follows the
  other: `upkeep`), and they spend PROBE_BUDGET_FAR (the spec_policy benchmark's MTP at B = 1, where
  drafting commits ~0.7 of 0's tokens per second: turns with a probe ran 0.94 of off's tokens per
  second, turns without 1.0, medians over 5 and 10 turns). A probe interrupted (another unit,
  another B) is dropped, but one whose first round is the first after another unit (a turn's first
  round after its prefills) runs on, that round timed as one of its K (unmeasured, such probes came
  every turn at B = 4). A request's counts decay with time (about the last 100 rounds count), so one
  whose estimate fell below the break-even drifts back to the prior's.
- Rows of requests with speculative="off" expect one token at every K; a round of only such
  rows is a round of 0. Only compiled Ks are chosen.
- While a waiting request may be admitted next (`filling`: a free lane, an admission not
  blocked), the round is the cheapest: the batch fills one request an iteration, and a
  drafting round delays the next admission by its extra time (four requests submitted
  together to the demo's DFlash Engine: the first row's drafting rounds alone, ~6 ms, ~2% of
  the turn at B = 4, which then waited for its last row).
- Bare rounds (a `window` W > 0, `bare`): a round of 0 may skip the drafter's upkeep (DFlash with
  a sliding-window drafter: its projections of the new position, 3-4% of a round of the embedded
  model on these cores; MTP: the head's K/V of it, up to 12% there) when its rows draft nothing,
  or when the choice for them is 0, W rounds of 0 ran in a row at their B (the rounds of a probe
  expected to lose aside) and either its next probe is more than W rounds away or a row ends
  before the upkeep still to run and the probe's two rounds (`_life`: the upkeep would be paid for
  nothing; the probe waits for the next rows). A row's context then lacks those positions:
  DFlash's until W rounds of upkeep later, MTP's for good (the head's attention skips them) but
  its last W positions whole after W rounds of upkeep (`RowOutlook.stale`). A choice that drafts
  for a stale row runs rounds of 0 with the upkeep first, so no probe or drafting round reads a
  context whose recent positions have holes; its drafting Ks are scored with those rounds first
  (their time, upkeep included, and a token a row each: `_score`), so a choice that would draft
  holds the bare rounds where what the rows draft after the upkeep does not pay for it (the demo's
  DFlash at B = 1, where fixed K = 15 ran 1.02 of off and the policy ran the upkeep for most
  rounds of a turn to draft a few rounds of 4-15: 0.86 of its own process's requests that drafted
  nothing). Only which K is best changes: the rest of the choice (its probe, their wait, how long
  it stands) is what it would be without the upkeep, as a choice the Engine makes without asking
  the rows' staleness is. A probe that drafts while 0 is the best runs once its window begins if
  its rows' contexts are whole (rows fresh from their prefills: no upkeep; the spec_policy
  benchmark's DFlash at B = 4, whose turns of 130 rounds paid the W = 64 rounds of upkeep in 3-11
  of 15 turns, 2 of 5 cut short by the turn's end in a traced run), and the next wait starts that
  much later (probes stay as far apart as their budget says); a choice whose probe's upkeep has
  begun keeps that probe and its wait.

Does not own: which K values exist (`ProgramConfig.round_drafts`, compiled at start), the
rows' limits (the Program clips them to K + 1), or exactness (every K gives the same greedy
tokens and the same sampled distribution: `program/speculative.py`).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

MIN_SAMPLES = 3  # measured rounds of a (K, B) before the policy trusts its time
WARM_ROUNDS = 2  # steady rounds of a (K, B) not measured, the first time it runs
SETTLE = 2  # rounds of 0 after a change that are not samples (their chain takes two to start)
WINDOW = 9  # the rounds a (K, B)'s time is taken over
NEAR = 8  # rounds within which two Ks' samples are a pair (taken under the same load)
PAIRS = 2 * WINDOW  # the pairs' ratios of two Ks a ratio is taken over
# Rounds a choice of the cheapest K stands while its rows stay the same: meanwhile only the
# cheapest round's time changes and the rows' acceptance decays (no round adds counts; a probe
# makes a new choice). Near the break-even it is scored again every REFRESH rounds; where every
# K that drafts is expected to commit under 1 - FAR of the cheapest's tokens per second, every
# REFRESH_FAR (scoring every K anew every 8 rounds took ~1% of the demo's 1 ms rounds of 0,
# where MTP drafting commits ~0.7 of it).
REFRESH = 8
REFRESH_FAR = 32
# Rounds a choice that drafts stands while its rows stay the same and every row that drafts may
# still commit a whole round of it (its budget past K), where it promises 1 + FAR of the
# cheapest's tokens per second or more (nearer the break-even: every round): its rounds add
# counts, so it is scored again sooner than the cheapest's. Scored every round, it took ~120 µs
# of the worker's CPU a round (the demo's DFlash at B = 1 through the Engine, on the critical
# path between two drafting rounds of ~6 ms; fixed K = 4's whole round plan took 34).
REFRESH_DRAFTING = 4
FAR = 0.15
# How much more a K that drafts must promise than the cheapest to be chosen: its estimate is the
# noisier (a request's acceptance from few rounds) and leaving the cheapest round's chain costs
# more than the steady rounds' times show.
MARGIN = 0.05
PROBE_EVERY = 32  # the fewest rounds at a B between probes
PROBE_BUDGET = 0.01  # the most of the time probes may add (a costlier probe waits longer)
PROBE_BUDGET_FAR = 0.004  # the same where drafting is FAR from winning (module docstring)
PROBE_MEMORY = 5  # measured probes of a (K, B) whose median loss spaces the next
PRIOR_WEIGHT = 4.0  # rounds of the prior acceptance a request's own counts start from
# A request's first rounds, whose drafts' counts make the prior: what a request of which nothing
# is known expects (counts of every round would promise it too much: the policy drafts most in
# the predictable stretches of requests).
OPENING = 8
# A request's acceptance counts' weight on the past, per round: about the last 100 rounds count,
# so an estimate that stopped getting counts (no K that drafts chosen) drifts back to the
# prior's. Applied every DECAY_EVERY rounds; the prior's counts decay by it per row counted.
DECAY = 0.99
DECAY_EVERY = 16
# How much more a drafting K must promise than the drafting K of the round before at its B
# (rounds of 0 aside): a change costs its first rounds (below, STINT: ~0.4 of a round over
# the next four on these cores), and choices that flipped between K = 3 and 7 every 1-4
# rounds paid it again and again (the demo's DFlash at B = 1).
SWITCH = 0.05
# Rounds into a run of one drafting K after which its rounds are steady: on these cores the
# rounds after a change of K are slower (the demo's DFlash at B = 1 through the Engine: K = 3
# 3.14, 3.05, 2.96, 2.91 ms in the 2nd-5th rounds of a run against 2.75 steady; K = 7 4.32,
# 4.22, 3.99, 4.09 against 3.84), and a K the policy does not hold runs only such rounds.
STINT = 5
# The same for rounds of 0 (with the drafter's upkeep: bare ones never start a run): after a
# drafting run they are slower for longer (the demo's DFlash at B = 1 through the Engine,
# rounds of 0 after three of K = 4 or 8: 1.30-1.52 ms in the 2nd-6th rounds of the run,
# 1.15-1.25 from the 12th; at B = 4 no difference, 3.0-3.1 ms throughout). Unsteadied, a
# drafting choice's rounds of 0 are such rounds: paired with the drafting K's samples they
# read a round of 0 ~15-20% slow (`_pair`, up to 1.95 ms against ~1.2 steady), and the demo's
# DFlash at B = 1 held K = 4 for whole turns at 0.93 of rounds of 0's tokens per second.
STINT_ZERO = 12
# What a round of 0 with the drafter's upkeep takes more than a bare one, in rounds, before
# the policy measured it at a B (`_upkeep`: through the Program on these cores, the spec_policy
# benchmark's "upkeep" lines: 0.02-0.13 for the demo's DFlash and MTP at B = 1 and 4). Where
# drafting is FAR from winning, a probe is charged the `window` of them before it: probed
# every ~140 rounds (its own loss), the demo's DFlash at B = 4 ran 3-12 of its ~125 rounds a
# turn bare. Near the break-even it is not: probes there are what gets a policy out of rounds
# of 0 chosen by mistake (charged everywhere, they came half as often at B = 1).
UPKEEP = 0.03
# How far from a K's own time the chain of paired ratios that links it to the anchor
# (`_chained`) must put it before it moves it (by what lies past BAND): the mix of rounds of 0
# behind the anchor's time (bare or with the upkeep, ~5% apart) and a chain's product of ratios
# move it by less, a burst of the machine since its samples by 2-3x. Moved within the band too,
# it made the policy slow to climb where drafting wins by about MARGIN (a text that turns
# predictable after bare rounds: the choice flipped back to 0 as the upkeep's rounds of 0
# raised the anchor's time by 5%).
BAND = 1.1
UNMEASURED = 0.5  # acceptance assumed at a position nobody measured
# A round's time is the mean of its last samples, each clipped at CLIP times their median
# (`_typical`): the median alone flattered rounds of 0, whose tail is the heavier (the demo's
# DFlash at B = 1, one K forced for whole turns: the mean 1.10-1.12x the median for rounds of 0,
# 1.01-1.02x for K = 4; turns of K = 4 committed 1.13 and 1.20x the tokens per second of turns
# of rounds of 0, the two's medians said 1.04 and 1.11x).
CLIP = 3.0
# Round times `round_done` keeps before adding them to the estimates when no choice asked for
# them (a fixed K's, a held run of bare rounds'), and the most rounds `stats` shows a changed
# time late.
KEPT_SAMPLES = 32
SHRINK = 2.0  # rows of the position before that a position's prior rate starts from


def _window(table: dict, key, maxlen: int) -> collections.deque:
    """table[key], a new deque of `maxlen` if it has none (`setdefault` would build one every
    call: on the Engine's worker the first deque a round took ~30 µs, its 528-byte block the
    C heap's first allocation of that size after the round's step)."""
    window = table.get(key)
    if window is None:
        window = table[key] = collections.deque(maxlen=maxlen)
    return window


def _median(xs) -> float:
    """statistics.median, without its checks (the policy takes several every round)."""
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _typical(xs) -> float:
    """A round's time from samples of it: their mean, each clipped at CLIP times their median
    (what the user's stream pays: rounds of 0 have the heavier tail; a stall past CLIP medians
    is not the round's)."""
    cap = CLIP * _median(xs)
    return sum(min(x, cap) for x in xs) / len(xs)


def _ends(rounds: list[float], tails: list[float]) -> list[float]:
    """[i]: the seconds until the row that ends after rounds[i] rounds ends (rounds[0] <=
    rounds[1] <= ...; len(rounds) of them running at first; tails[n]: a round of n rows)."""
    seconds = done = 0.0
    alive = len(rounds)
    ends = []
    for n in rounds:
        seconds += (n - done) * tails[alive]
        ends.append(seconds)
        done, alive = n, alive - 1
    return ends


def _speeds(budgets: list[float], ends: list[float], lead: float) -> float:
    """The rows' speed as their streams see it while nothing waits: rows over the sum of each
    row's seconds a token (from now, `lead` + ends[i], to its end; its tokens per second for one
    row). A K that ends the rows it suits sooner gains though the last row ends when it would
    have; one that slows a row counts that row's loss in full, not in proportion to its tokens
    per second."""
    return len(budgets) / max(sum((lead + e) / n for n, e in zip(budgets, ends)), 1e-12)


def _steps(prior: list[float]) -> list[float]:
    """[i]: the prior's ratio of position i + 1's rate to position i's (`DraftPolicy._rates`;
    the last one unused)."""
    return [g / max(p, 1e-6) for p, g in itertools.pairwise(prior)] + [0.0]


def _life(rows: Sequence[RowOutlook]) -> int:
    """The fewest tokens a row that drafts may still commit (its budget)."""
    return min((r.budget for r in rows if r.acceptance is not None), default=0)


def _stale(rows: Sequence[RowOutlook]) -> int:
    """Rounds of upkeep until every row that drafts has its drafter context whole (0 where
    `RowOutlook.stale` was not asked: `Rounds` asks only for a choice that drafts)."""
    return max((r.stale for r in rows if r.acceptance is not None), default=0)


def _rows_key(rows: Sequence[RowOutlook], refill: bool) -> tuple:
    """What a choice was made for: refill, then the rows' requests."""
    return (refill, *(id(r.acceptance) for r in rows))


class RowAcceptance:
    """One request's accepted / attempted drafts by position (conditional: attempted when
    every draft before it was accepted), decayed as the prior's counts are."""

    def __init__(self, positions: int):
        self.attempted = [0.0] * positions
        self.accepted = [0.0] * positions
        self.age = 0  # decode rounds it was in

    def decay(self, factor: float) -> None:
        self.attempted = [x * factor for x in self.attempted]
        self.accepted = [x * factor for x in self.accepted]


class RowOutlook(NamedTuple):
    """What the policy knows of a row for the next round (a tuple: the Engine makes one a row
    every round)."""

    acceptance: RowAcceptance | None  # None: the request speculates nothing ("off", a mask)
    budget: int  # the most tokens the row may commit this round (its max_new_tokens left, cap)
    stale: int = 0  # rounds of upkeep until its drafter context is whole (after bare rounds)


@dataclasses.dataclass(frozen=True)
class _Choice:
    rows: tuple  # refill, then the rows' requests (ids of their RowAcceptance)
    round: int  # the round it was made
    ks: list[int]  # the Ks it chose among
    best: int
    gain: float  # best's expected tokens per second over a round of 0's
    probe: int  # the next probe's K
    stands: int  # rounds it stands while the rows stay the same (`_standing`)
    # whether the probe is expected to lose by MARGIN or more: its rounds then leave a run of
    # rounds of 0 standing (`bare`)
    probe_loses: bool
    wait: float  # rounds at this B before it
    rate: float  # tokens per second a round of the best is expected to commit
    round_s: float  # best's round
    stale: int = 0  # the rounds of upkeep its drafting Ks were charged first (`_score`)


@dataclasses.dataclass
class _Probe:
    """A probe's rounds and the change back, as they land: what it lost."""

    k: int
    b: int
    rate: float  # the tokens per second a round of the best was expected to commit
    round_s: float  # the best's round
    seconds: float = 0.0
    tokens: int = 0
    settle: int = SETTLE  # rounds of another K still to count


class DraftPolicy:
    """Chooses each decode round's K among `round_drafts` (one of them: a fixed K) and counts
    what happened. Only the Engine's worker thread touches it."""

    def __init__(self, round_drafts: Sequence[int], method: str, window: int = 0):
        self.ks = tuple(round_drafts)
        self.kmax = self.ks[-1]
        self.method = method
        self.adaptive = len(self.ks) > 1
        self.window = window if self.adaptive else 0  # `bare`: ProgramLimits.context_window
        self._times: dict[tuple[int, int], collections.deque] = {}  # (K, B) -> seconds
        self._typical: dict[tuple[int, int], float] = {}  # (K, B) -> `_typical` of them
        self._at: dict[tuple[int, int], collections.deque] = {}  # (K, B) -> their rounds
        # (K, J, B) -> t(K) / t(J) of samples of K and the J samples of the NEAR rounds before
        self._pairs: dict[tuple[int, int, int], collections.deque] = {}
        self._ratios: dict[tuple[int, int, int], float | None] = {}  # (K, J, B) -> `_ratio`
        self._chains: dict[tuple[int, int, int], float | None] = {}  # (K, J, B) -> `_chained`
        self._measured: dict[tuple[int, int], int] = {}  # (K, B) -> the round of its last
        self._warm: collections.Counter = collections.Counter()  # (K, B) -> steady rounds
        self._ready: set[tuple[int, int]] = set()  # (K, B) whose executable is compiled
        self._all_ready: dict[int, list[int]] = {}  # B -> every K, once all are compiled
        self._attempted = [0.0] * self.kmax  # the prior's: rows of openings and probes
        self._accepted = [0.0] * self.kmax
        self._prior: tuple[list[float], list[float]] | None = None  # `_prior_rates`, `_steps`
        self._round = 0  # decode rounds dispatched
        self._since_probe: collections.Counter = collections.Counter()  # B -> rounds
        self._zeros: collections.Counter = collections.Counter()  # B -> rounds of 0 in a row
        # B -> rounds in a row that kept the drafter's context (any but a bare one)
        self._kept: collections.Counter = collections.Counter()
        self._probes: collections.Counter = collections.Counter()  # B -> probes made
        # B -> [K, rounds, `_Choice.probe_loses`] of a probe's rounds to come
        self._plan: dict[int, list] = {}
        self._probing: _Probe | None = None  # the probe being measured
        # (K, B) -> the measured losses of its last probes, in rounds of the best
        self._probe_lost: dict[tuple[int, int], collections.deque] = {}
        self._choice: dict[int, _Choice] = {}  # B -> the last choice
        self._displaced: dict[int, _Choice | None] = {}  # B -> the choice before it
        self._last: tuple[int, int, float] | None = None  # (K, B, time) of the last round
        self._run = 0  # rounds of that K and B in a row
        self.rounds_by_kb: collections.Counter = collections.Counter()  # (K, B) -> rounds
        self.rounds_by_k: collections.Counter = collections.Counter()  # K -> rounds, every B
        self.rows = 0  # rows of rounds with drafts that committed tokens
        self.tokens = 0  # tokens they committed
        self._cum_attempted = [0] * self.kmax  # per position: the row's limit allowed it
        self._cum_accepted = [0] * self.kmax  # and drafts 0..i were all accepted
        self._cum: tuple | None = None  # `stats`' acceptance by position until a row adds
        self._gain = [0.0, 0]  # sum of estimated gains of chosen K over K = 0, rounds
        self._round_ms: tuple | None = None  # `stats`' (K, B, ms), rebuilt as `stats` says
        self._round_ms_stale = False  # a time changed since (`_round_ms_at`: the round then)
        self._round_ms_at = 0
        # (K, B) -> seconds of rounds STINT or more into a run of K (drafting Ks; of 0: with
        # the upkeep, STINT_ZERO or more)
        self._steady: dict[tuple[int, int], collections.deque] = {}
        # (B, r) -> seconds of rounds r < STINT into a run over their K's steady median
        self._slow: dict[tuple[int, int], collections.deque] = {}
        # (B, r) -> the same for rounds of 0 with the upkeep, r < STINT_ZERO (their steady
        # ones: `_steady[(0, B)]`)
        self._slow_zero: dict[tuple[int, int], collections.deque] = {}
        self._explored: set[int] = set()  # Bs whose first exploration ended
        # (K, B, seconds, round, bare) of the round times not yet in the estimates
        # (`take_samples`)
        self._samples: list[tuple[int, int, float, int, bool]] = []
        # B -> [bare, its last NEAR seconds, the stretch before's `_typical` or None, the round
        # of its last]: the stretch of rounds of 0 of one kind (bare or with the
        # upkeep) being taken
        self._stretch: dict[int, list] = {}
        self._upkeep: dict[int, collections.deque] = {}  # B -> ratios, upkeep over bare

    # The choice ----------------------------------------------------------------------------
    def choose(self, rows: Sequence[RowOutlook], ready: Callable[[int, int], bool],
               refill: bool = False, filling: bool = False) -> int:
        """The round's K for `rows` (B = len(rows)), without changing the policy (it may be
        asked again before the round is dispatched). `ready(k, b)`: whether that round's
        executable is compiled (one that is not is never waited for, the largest aside).
        `refill`: requests are waiting, so a row that ends is replaced (the round's own tokens
        per second count); else these rows' own speeds to their ends do. `filling`: a waiting
        request may be admitted next: the cheapest round (module docstring)."""
        b = len(rows)
        if not self.adaptive:
            return self.kmax
        ks = self._all_ready.get(b)
        if ks is None:
            ks = [k for k in self.ks if (k, b) in self._ready or self._check_ready(k, b, ready)]
            if len(ks) == len(self.ks):  # an executable stays compiled
                self._all_ready[b] = ks
        if len(ks) == 1:  # the others still compiling
            return ks[0]
        if filling or all(r.acceptance is None or r.budget <= 1 for r in rows):
            return ks[0]  # the batch fills, or nothing to draft: the cheapest round
        k = self._choose(rows, ks, refill)
        if k != ks[0] and any(r.stale and r.acceptance is not None for r in rows):
            return ks[0]  # a block would miss what bare rounds left out: the upkeep first
        return k

    def _choose(self, rows: Sequence[RowOutlook], ks: list[int], refill: bool) -> int:
        b = len(rows)
        if b in self._plan and self._plan[b][0] in ks:
            return self._plan[b][0]
        made = self._standing(rows, ks, refill)
        if made is not None:  # before the checks below: the steady path
            return made.probe if self._due(made, rows) else made.best
        self.take_samples()
        if not any(self._known(k, b) for k in ks) and any(
                self._known(*key) for key in self._typical if key[1] != b):
            return ks[0]  # a new B: its cheapest round's time scales the others'
        if b not in self._explored:
            for k in reversed(ks):  # explore: the largest first, the Program's fixed choice
                if not self._estimated(k, b) or self._unsteady(k, b):
                    return k
            if not self._known(ks[0], b):  # the cheapest measured here, never scaled
                return ks[0]
            self._explored.add(b)
        made = self._choice_for(rows, ks, refill)
        return made.probe if self._due(made, rows) else made.best

    def _due(self, made: _Choice, rows: Sequence[RowOutlook]) -> bool:
        """Whether the choice's probe runs this round: its wait is over and, for a probe that
        drafts, every row that drafts lives through its two rounds (drafts a row's end cuts
        would time K for fewer tokens; the probe waits for rows that do)."""
        return self._since_probe[len(rows)] >= self._due_at(made) and (
            made.probe == made.ks[0] or _life(rows) >= 2 * (made.probe + 1))

    def _due_at(self, made: _Choice) -> float:
        """Rounds at its B after which the choice's probe runs: its wait, less the `window`
        for a probe that drafts while the cheapest round is the best (it runs once its rows'
        contexts are whole, `choose`: at once for rows fresh from their prefills, else after
        the upkeep the window of rounds before its wait gives them)."""
        early = self.window if made.best == made.ks[0] != made.probe else 0
        return made.wait - early

    def bare(self, rows: Sequence[RowOutlook], refill: bool = False) -> bool:
        """Whether a round of 0 drafts (what `choose` just gave for `rows`) may skip the
        drafter's upkeep (`HostProgram.decode(bare=True)`; a `window` of W > 0): when its rows
        draft nothing, or when drafting loses for them (the choice's best is 0) and their B's
        next probe is more than W rounds away (its rows' contexts whole again by then) or a row
        ends before the upkeep still to run and the probe's rounds (`_life`), after W
        rounds of 0 in a row at B (a choice that turns to drafting waits for the rows'
        contexts, `choose`: up to W rounds of its gain, which a choice that hovers near the
        break-even would pay again and again); the rounds of a probe expected to lose by
        MARGIN or more do not break that run (the demo's DFlash at B = 4, probed every ~220
        rounds near the break-even: with W = 64 rounds of upkeep after each probe too, 21-51%
        of its rounds were bare in the spec_policy benchmark, 69-93% without them)."""
        if not self.window:
            return False
        if all(r.acceptance is None or r.budget <= 1 for r in rows):
            return True
        b = len(rows)
        made = self._choice.get(b)
        return made is not None and made.rows == _rows_key(rows, refill) and made.best == 0 \
            and self._zeros[b] >= self.window and b not in self._plan \
            and self._probing is None and (
                self._since_probe[b] < self._due_at(made)
                or _life(rows) < max(self.window - self._kept[b], 0) + 2 * (made.probe + 1))

    def holds(self, b: int) -> int:
        """After a bare round of 0 at B is dispatched (`bare` said so), the rounds after it in
        which `choose` and `bare` say so again for the same rows with nothing waiting,
        whatever their budgets: its choice stands (its `stands` rounds) and its next probe's
        upkeep (`window` rounds before it) has not begun (`Rounds.chain_plan` then asks
        nothing: the worker's host work a round comes near a fixed policy's)."""
        made = self._choice.get(b)
        if not self.window or made is None or made.best != 0 \
                or made.ks != self._all_ready.get(b) or b in self._plan \
                or self._probing is not None:
            return 0
        return max(0, min(made.round + made.stands - self._round,
                          math.ceil(self._due_at(made) - self._since_probe[b])))

    def _check_ready(self, k: int, b: int, ready: Callable[[int, int], bool]) -> bool:
        """Whether a round of K at B may run now (the largest always: it is waited for);
        remembered once true (an executable stays compiled)."""
        if k == self.kmax or ready(k, b):
            self._ready.add((k, b))
            return True
        return False

    def _standing(self, rows: Sequence[RowOutlook], ks: list[int],
                  refill: bool) -> _Choice | None:
        """The last choice at the rows' B when it was made among the same `ks` for the same
        rows less than its `stands` rounds ago (made once every K had an estimate there, so it
        stands without them) and, if it drafts, every row that drafts may still commit a whole
        round of it (a budget that cuts its round is scored anew: its tokens fall, the others'
        Ks' less), else None."""
        made = self._choice.get(len(rows))
        if made is not None and made.ks == ks and self._round - made.round < made.stands \
                and (made.best == ks[0] or (_life(rows) > made.best
                                            and _stale(rows) <= made.stale)) \
                and made.rows == _rows_key(rows, refill):
            return made
        return None

    def _choice_for(self, rows: Sequence[RowOutlook], ks: list[int], refill: bool) -> _Choice:
        """The K of most expected tokens per second for these rows and the next probe. A choice
        of the cheapest K stands REFRESH (far from the break-even REFRESH_FAR) rounds while the
        rows stay the same (its rounds add no acceptance counts); one that drafts
        REFRESH_DRAFTING far from the break-even, else one (its rounds do: `_stands`)."""
        b = len(rows)
        key = _rows_key(rows, refill)
        made = self._standing(rows, ks, refill)
        if made is not None:
            return made
        if self._prior is None:  # kept until the prior's counts change (openings, probes)
            rates = self._prior_rates()
            self._prior = rates, _steps(rates)
        prior, steps = self._prior
        by_row = [self._row_expected(r, self._rates(r.acceptance, prior, steps))
                  for r in rows]
        anchor = self._anchor(b)
        times = {k: self._time(k, b, anchor) for k in ks}
        expected = {k: [e[min(k, len(e) - 1)] for e in by_row] for k in ks}
        tails = None if refill or b == 1 else {  # one row: the round's rate is its work's
            k: self._tail_times(k, b, times[k], ks[0]) for k in ks}
        scores = {k: self._score(rows, expected[k], k, ks[0], times, tails) for k in ks}
        ranked, stale = scores, _stale(rows)
        if stale:  # the drafting Ks pay the upkeep first: that changes only which K is best
            lead = stale * times[ks[0]] * (1.0 + self.upkeep(b))
            ranked = {k: scores[k] if k == ks[0] else self._score(
                rows, expected[k], k, ks[0], times, tails, (stale, lead)) for k in ks}
        held = self._last[0] if self._last is not None and self._last[1] == b else 0
        best = max(ks, key=lambda k: (ranked[k] / (1.0 if k == ks[0] else 1.0 + MARGIN) / (
            1.0 + SWITCH if held and k not in (held, ks[0]) else 1.0), -k))
        probe = self._probe(best, b, ks, scores)
        # a probe may add at most PROBE_BUDGET of the time: what the last ones lost, measured;
        # before any, two rounds of its K (the second measures its time) that lose what their
        # tokens would have taken less at the best's rate, and a change each way (about a
        # round of the best)
        measured = self._probe_lost.get((probe, b))
        if measured:
            lost = _median(measured)
        else:
            lost = 2.0 * times[probe] / times[best] * max(
                1.0 - scores[probe] / scores[best], 0.0) + 1.0
        far = max(scores[k] for k in ks[1:]) < (1.0 - FAR) * scores[ks[0]]
        if far:  # and the `window` rounds of upkeep before it, which bare rounds would skip
            lost += self.window * self.upkeep(b)
        wait = max(PROBE_EVERY, lost / (PROBE_BUDGET_FAR if far else PROBE_BUDGET))
        last = self._choice.get(b)
        if last is not None and last.round == self._round and last.rows == key:
            last = self._displaced.get(b)  # made again with the rows' stale (`_standing`)
        else:
            self._displaced[b] = last
        if best == ks[0] and last is not None and last.best == best and self.window \
                and self._since_probe[b] >= self._due_at(last):
            probe, wait = last.probe, last.wait  # its upkeep has begun: the probe stays
        if best != ks[0] and not self._pairs.get((ks[0], best, b)) and \
                self._last is not None and self._last[:2] == (best, b) and self._run >= 2:
            # a drafting choice timed only against rounds of the cheapest before it (a load
            # that eased in between flatters it): the cheapest runs next, after its samples
            probe, wait = ks[0], 0
        made = self._choice[b] = _Choice(key, self._round, ks, best,
                                         scores[best] / scores[ks[0]], probe,
                                         self._stands(best, ks[0], far, scores),
                                         scores[probe] < (1.0 - MARGIN) * scores[best], wait,
                                         sum(expected[best]) / times[best], times[best], stale)
        return made

    @staticmethod
    def _stands(best: int, cheapest: int, far: bool, scores: dict[int, float]) -> int:
        """Rounds a choice stands (`_standing`): of the cheapest K, REFRESH (REFRESH_FAR where
        every K that drafts is FAR from it); of a K that drafts, REFRESH_DRAFTING where it
        promises 1 + FAR of the cheapest's tokens per second or more, else one (near the
        break-even one round's counts may turn it, and a wrong drafting K costs the most
        there)."""
        if best == cheapest:
            return REFRESH_FAR if far else REFRESH
        return REFRESH_DRAFTING if scores[best] >= (1.0 + FAR) * scores[cheapest] else 1

    def _score(self, rows: Sequence[RowOutlook], expected: list[float], k: int, cheapest: int,
               times: dict[int, float], tails: dict[int, list[float]] | None,
               first: tuple[int, float] = (0, 0.0)) -> float:
        """Expected tokens per second at K for rows expecting expected[i] tokens a round
        (times: each K's round at the rows' B).
        With requests waiting (`tails` None: refill), of the round. Else the rows' speed to
        their ends (`_speeds`): row i needs budget_i / E_i rounds, and the rows that end first
        leave rounds of fewer rows (tails[K][n]: a round of K with n rows; a row's budget is
        its tokens left or its cap), with K kept to the end or, if faster, until the first row
        ends and the cheapest round after it. `first`: (s, seconds): s rounds of 0 with the
        drafter's upkeep run first, taking those seconds and committing a token a row each
        (rows that bare rounds left stale: the upkeep is paid for by what the rows draft after
        it, so near a row's end or the break-even a choice that would draft holds the bare
        rounds of 0)."""
        b = len(rows)
        t = times[k]
        stale, lead = first
        if tails is None and not stale:
            return sum(expected) / t
        budgets = [max(r.budget, 1) for r in rows]
        after = [max(n - stale, 0) for n in budgets]
        if tails is None:  # with refill: what follows the upkeep at the round's rate
            return sum(budgets) / max(lead + sum(after) * t / sum(expected), 1e-12)
        order = sorted(range(b), key=lambda i: after[i] / expected[i])
        ends = _ends([after[i] / expected[i] for i in order], tails[k])
        score = _speeds([budgets[i] for i in order], ends, lead)
        if k != cheapest and b > 1:  # or K until the first row ends, then the cheapest
            first_end = after[order[0]] / expected[order[0]]
            left = {i: after[i] - first_end * expected[i] for i in order[1:]}
            rest = sorted(left, key=left.get)
            ends = [first_end * t] + [first_end * t + e for e in _ends(
                [max(left[i], 0.0) for i in rest], tails[cheapest])]
            score = max(score, _speeds([budgets[i] for i in [order[0], *rest]], ends, lead))
        return score

    def _tail_times(self, k: int, b: int, t: float, cheapest: int) -> list[float]:
        """[n]: a round of K with n <= B rows (a round of all B takes t): measured, else t
        scaled as the cheapest K's rounds scale, else in proportion to the rows."""
        tails = [0.0] * (b + 1)
        tails[b] = t
        for n in range(1, b):
            if self._known(k, n):
                tails[n] = self._typical[(k, n)]
            elif self._known(cheapest, n) and self._known(cheapest, b):
                tails[n] = t * self._typical[(cheapest, n)] / max(
                    self._typical[(cheapest, b)], 1e-9)
            else:
                tails[n] = t * n / b
        return tails

    def _probe(self, best: int, b: int, ks: list[int], scores: dict[int, float]) -> int:
        """The next probe's K. While the cheapest K is the best, the drafting K of the highest
        score (the one that would beat it first, and the cheapest probe: with the largest and
        the oldest in turn, runs of the demo's DFlash at B = 1 that held rounds of 0 by
        mistake went 380-760 rounds without a probe). Else in turn the cheapest (whether
        drafting pays at all: timed only by the last choice of it, rounds of 0 stayed the 1.7x
        of a slow stretch while the demo's DFlash at B = 1 drafted K = 4 for 16 turns, every
        round, at 0.7-0.9 of rounds of 0's tokens per second), the largest (every position's
        acceptance at once; when that is the best, the K below it) and the K whose time is the
        oldest (no estimate stays from a cold start or a busy moment)."""
        others = [k for k in ks if k != best]
        if best == ks[0]:
            return max(others, key=lambda k: (scores[k], -k))
        turn = self._probes[b] % 3
        if turn == 0:
            return ks[0]
        if turn == 1:
            return others[-1]
        return min(others, key=lambda k: self._measured.get((k, b), -1))

    def dispatched(self, k: int, rows: Sequence[RowOutlook], bare: bool = False) -> None:
        """Counts a round of K (the one `choose` gave, or the largest for a fixed policy;
        `bare`: a round of 0 that skipped the drafter's upkeep, as `bare` allowed)."""
        self.rounds_by_kb[(k, len(rows))] += 1
        self.rounds_by_k[k] += 1
        if not self.adaptive:
            return
        b = len(rows)
        self._kept[b] = 0 if bare else self._kept[b] + 1
        for r in rows:
            if r.acceptance is not None:
                r.acceptance.age += 1
        made = self._choice.get(b)
        self._round += 1
        if self._round % DECAY_EVERY == 0:
            self._decay(rows)
        if made is not None and made.best == k:
            self._gain[0] += made.gain
            self._gain[1] += 1
        if any(r.acceptance is not None and r.budget > 1 for r in rows):
            self._since_probe[b] += 1  # the time probes spend is of rows that may draft
        keep = False  # a probe's round expected to lose: the run of 0s stands (`bare`)
        if b in self._plan and self._plan[b][0] == k:  # a probe's later round
            keep = self._plan[b][2]
            self._plan[b][1] -= 1
            if not self._plan[b][1]:
                del self._plan[b]
        elif made is not None and k == made.probe and k != made.best \
                and self._since_probe[b] > self._due_at(made):  # a probe's first round: it
            # runs until its time has a sample (of the cheapest round, MIN_SAMPLES: they cost
            # nothing)
            keep = made.probe_loses
            self._plan[b] = [k, SETTLE + MIN_SAMPLES - 1 if k == made.ks[0] else 1, keep]
            self._probing = _Probe(k, b, made.rate, made.round_s)
            self._probes[b] += 1
            # one that ran early (its rows' contexts whole) starts the next wait that much
            # later: probes stay as far apart as their budget says
            self._since_probe[b] = min(0, math.floor(self._since_probe[b] - made.wait))
            del self._choice[b]  # the next probe is another
        if k == 0:
            self._zeros[b] += 1
        elif not keep:
            self._zeros[b] = 0

    def _decay(self, rows: Sequence[RowOutlook]) -> None:
        factor = DECAY**DECAY_EVERY
        for r in rows:
            if r.acceptance is not None:
                r.acceptance.decay(factor)

    @staticmethod
    def _row_expected(row: RowOutlook, rates: list[float]) -> list[float]:
        """[K]: the tokens a row expects of a round of K, 1 + sum_{j=1..min(K, budget-1)}
        prod_{i<j} a_i (a row that drafts nothing: 1), for K = 0, 1, ... up to its budget - 1
        or len(rates) (a larger K expects the last), in one pass."""
        out = [1.0]
        if row.acceptance is None:
            return out
        total = p = 1.0
        for rate in rates[:max(row.budget - 1, 0)]:
            p *= rate
            total += p
            out.append(total)
        return out

    def _prior_rates(self) -> list[float]:
        """Per position, the chance that draft i is right given drafts 0..i-1 were, in the
        first OPENING rounds of requests and in probes: the counts shrunk toward the position
        before (few samples reach deep positions)."""
        rates, prior = [], UNMEASURED
        for i in range(self.kmax):
            prior = (self._accepted[i] + SHRINK * prior) / (self._attempted[i] + SHRINK)
            rates.append(prior)
        return rates

    @staticmethod
    def _rates(own: RowAcceptance | None, prior: list[float],
               steps: list[float] | None = None) -> list[float]:
        """A request's rates: its own counts on PRIOR_WEIGHT rounds of an anchor, the prior
        at position 0 and deeper its own rate at the position before times the prior's ratio
        of the two (a request whose shallow drafts are all right expects the deep ones it
        never reached to be right as often as the prior's shape says, not the prior's own
        rates). `steps`: `_steps(prior)`, when the caller has it."""
        if own is None:
            return prior
        rates: list[float] = []
        anchor, w = prior[0], PRIOR_WEIGHT
        for acc, att, step in zip(own.accepted, own.attempted, steps or _steps(prior)):
            rate = (acc + w * anchor) / (att + w)
            rates.append(rate)
            anchor = min(1.0, rate * step)
        return rates

    def _unsteady(self, k: int, b: int) -> bool:
        """Whether a drafting K measured at B has fewer than MIN_SAMPLES steady rounds (STINT
        or more into a run) while its window of times is not full (runs cut short again and
        again, by requests that end, stop asking)."""
        return k > 0 and self._known(k, b) and len(self._times[(k, b)]) < WINDOW and len(
            self._steady.get((k, b), ())) < MIN_SAMPLES

    def _known(self, k: int, b: int) -> bool:
        return len(self._times.get((k, b), ())) >= MIN_SAMPLES

    def _estimated(self, k: int, b: int) -> bool:
        """Whether `_time(k, b)` has an estimate (without computing it: `choose` asks every
        round)."""
        return self._known(k, b) or any(True for _ in self._scales(k, b))

    def _scales(self, k: int, b: int):
        """(other B, reference K) pairs that scale K's time at another B to this one: K known
        there, the reference known at both."""
        return ((other, ref) for (kk, other) in self._typical
                if kk == k and self._known(k, other)
                for ref in self.ks if self._known(ref, b) and self._known(ref, other))

    def _time(self, k: int, b: int, anchor: int | None = -1) -> float | None:
        """A round's seconds: measured at this B (for a K other than the anchor, the anchor's
        time times their paired ratio, once there are MIN_SAMPLES pairs; without one, its own
        time moved past BAND by the chain of ratios that links it to the anchor), else the
        time of a K measured here scaled by the two's ratio at the nearest B where both were
        (None: no estimate). `anchor`: `_anchor(b)` when the caller has it (-1: looked up here)."""
        if self._known(k, b):
            if anchor == -1:
                anchor = self._anchor(b)
            if anchor is not None and anchor != k:
                ratio = self._ratio(k, anchor, b)
                if ratio is not None:
                    return max(self._typical[(anchor, b)] * ratio, 1e-9)
                ratio = self._chained(k, anchor, b)
                if ratio is not None:  # its own time, moved by what lies past BAND
                    own = self._typical[(k, b)]
                    moved = self._typical[(anchor, b)] * ratio / max(own, 1e-12)
                    return max(own * min(1.0, moved * BAND) * max(1.0, moved / BAND), 1e-9)
            return max(self._typical[(k, b)], 1e-9)
        pairs = [(abs(other - b), self._scaled(k, b, other, ref))
                 for other, ref in self._scales(k, b)]
        return max(min(pairs)[1], 1e-9) if pairs else None

    def _scaled(self, k: int, b: int, other: int, ref: int) -> float:
        """K's time at B from its time at another B and a reference K known at both: the
        larger of the reference's time here times their ratio there, and the reference's time
        here plus K's extra over it there in proportion to the rows (a verify's extra work
        grows with its rows, a round of 0's less: the ratio alone under-estimated the demo's
        DFlash K = 3 at B = 4 from B = 1, 5.2 ms against 6.4; the extra alone under-estimates
        a smaller B). A drafting K from a smaller B and a cheaper reference: the least it can
        take (no fewer rows there, no more drafts in the reference), so that where it may win
        it runs and is measured: neither scaling holds on every machine (the extra read the
        demo's DFlash K = 8 at B = 4 ~29 ms where it took ~15), and a K scaled too slow is
        never measured (its probes, spaced by the loss they are expected to have, came a few
        times in 15 turns of the spec_policy benchmark, and drafted two rounds each)."""
        here, there, k_there = self._typical[(ref, b)], self._typical[(ref, other)], \
            self._typical[(k, other)]
        if k and ref < k and other < b:  # the least it can take: K runs where that may win
            return max(k_there, here)
        return max(here * k_there / max(there, 1e-9), here + (k_there - there) * b / other)

    def _ratio(self, k: int, j: int, b: int) -> float | None:
        """t(K) / t(J) at B from their pairs: the geometric mean of the `_typical` ratio of
        K's samples to the J samples before them and the inverse of that of J's samples to the
        K samples before them (a load that changed between the two sides of a pair biases the
        two directions the opposite way). None before MIN_SAMPLES pairs. Kept until a pair of
        the two comes."""
        if (k, j, b) in self._ratios:
            return self._ratios[(k, j, b)]
        self._ratios[(k, j, b)] = ratio = self._paired_ratio(k, j, b)
        return ratio

    def _chained(self, k: int, anchor: int, b: int) -> float | None:
        """t(K) / t(anchor) at B through the Ks between them, where the two have no pairs of
        their own: the product of the paired ratios along the shortest chain of Ks each paired
        with the next (the first exploration pairs each K with the one it ran after), None
        without one. Kept until a pair at B comes."""
        key = (k, anchor, b)
        if key in self._chains:
            return self._chains[key]
        ratio, level, seen = None, [(anchor, 1.0)], {anchor}  # (J, t(J) / t(anchor))
        while level and ratio is None:
            nearer = []
            for j, to_anchor in level:
                for other in self.ks:
                    if other in seen or (r := self._ratio(other, j, b)) is None:
                        continue
                    seen.add(other)
                    nearer.append((other, r * to_anchor))
                    if other == k:
                        ratio = r * to_anchor
            level = nearer
        self._chains[key] = ratio
        return ratio

    def _paired_ratio(self, k: int, j: int, b: int) -> float | None:
        after, before = self._pairs.get((k, j, b), ()), self._pairs.get((j, k, b), ())
        if len(after) + len(before) < MIN_SAMPLES:
            return None
        if after and before:
            return (_typical(after) / _typical(before)) ** 0.5
        return _typical(after) if after else 1.0 / _typical(before)

    def _anchor(self, b: int) -> int | None:
        """The known K at B whose latest sample is the most recent (None: none known)."""
        known = [k for k in self.ks if self._known(k, b) and (k, b) in self._at]
        return max(known, key=lambda k: self._at[(k, b)][-1]) if known else None

    def _pair(self, k: int, b: int, seconds: float, at: int) -> None:
        """Pairs a sample of (K, B) taken at round `at` with every other K's samples at B of
        the NEAR rounds before (their `_typical`)."""
        for j in self.ks:
            rounds = self._at.get((j, b))
            if j == k or rounds is None or at - rounds[-1] > NEAR:
                continue
            near = [t for t, r in zip(self._times[(j, b)], rounds) if at - r <= NEAR]
            if near:
                _window(self._pairs, (k, j, b), PAIRS).append(
                    seconds / max(_typical(near), 1e-9))
                self._ratios.pop((k, j, b), None)
                self._ratios.pop((j, k, b), None)
                self._chains.clear()

    def take_samples(self) -> None:
        """Adds the round times `round_done` kept (`_samples`) to the estimates, in their
        order, as if each had been added as it landed (the EngineCore asks as a request ends:
        stats read after its Finished count its rounds)."""
        if not self._samples:
            return
        touched = set()
        start = 0
        while start < len(self._samples):  # runs of one (K, B)
            k, b = self._samples[start][:2]
            end = start + 1
            while end < len(self._samples) and self._samples[end][:2] == (k, b):
                end += 1
            run = self._samples[start:end]  # the other Ks' samples stay as they are meanwhile
            start = end
            latest = max((self._at[(j, b)][-1] for j in self.ks
                          if j != k and (j, b) in self._at), default=None)
            if self.adaptive and latest is not None:  # a fixed K compares nothing
                for _, _, seconds, at, _ in run:
                    if at - latest > NEAR:
                        break  # and every later one of the run: nothing left to pair with
                    self._pair(k, b, seconds, at)
            if k == 0 and self.window:
                self._take_stretches(b, run)
            _window(self._times, (k, b), WINDOW).extend(s[2] for s in run)
            _window(self._at, (k, b), WINDOW).extend(s[3] for s in run)
            self._measured[(k, b)] = run[-1][3]
            touched.add((k, b))
        self._samples.clear()
        for key in touched:
            typical = _typical(self._times[key])
            if key not in self._typical:
                self._round_ms = None  # a new (K, B): shown at once
            elif self._typical[key] != typical:
                self._round_ms_stale = True
            self._typical[key] = typical

    def _take_stretches(self, b: int, run: list) -> None:
        """Times the upkeep from samples of rounds of 0 at B: a stretch of one kind (bare or
        with the upkeep) that follows one of the other kind, once it has MIN_SAMPLES + 1
        samples, gives the ratio of the two's `_typical` (of the one before, its last NEAR,
        if it ended 2 * NEAR rounds before at most: the two taken close together, as pairs of
        Ks are). Between them may lie a probe's rounds, whose upkeep before it is what the
        ratio prices."""
        st = self._stretch.get(b)
        for _, _, seconds, at, bare in run:
            if st is None or st[0] != bare:
                before = _typical(st[1]) if st is not None and len(
                    st[1]) >= MIN_SAMPLES and at - st[3] <= 2 * NEAR else None
                st = self._stretch[b] = [bare, collections.deque(maxlen=NEAR), before, at]
            st[1].append(seconds)
            st[3] = at
            if st[2] is not None and len(st[1]) > MIN_SAMPLES:
                now = _typical(st[1])
                kept, bare_s = (st[2], now) if bare else (now, st[2])
                _window(self._upkeep, b, WINDOW).append(kept / max(bare_s, 1e-12))
                st[2] = None

    def upkeep(self, b: int) -> float:
        """What a round of 0 with the drafter's upkeep takes more than a bare one at B, in
        rounds: the median of the measured ratios less one (UPKEEP before MIN_SAMPLES; at
        least 0)."""
        ratios = self._upkeep.get(b)
        if ratios is None or len(ratios) < MIN_SAMPLES:
            return UPKEEP
        return max(_median(ratios) - 1.0, 0.0)

    # What happened -------------------------------------------------------------------------
    def round_done(self, k: int, b: int, now: float, tokens: int, bare: bool = False) -> None:
        """A decode round of K drafts and B rows whose output was read at `now` (monotonic
        seconds) committed `tokens`; the time since the last one is its time when that one had
        the same K and B (and tokens / time its rate; `bare`: a round of 0 that skipped the
        drafter's upkeep, whose time also prices the upkeep, `upkeep`). The
        first round after a change is not a sample, nor for rounds of 0 the first SETTLE: they
        carry the change (a round chained ahead lands, a chain of rounds of 0 starts), which
        steady rounds do not; nor are the first WARM_ROUNDS steady ones of a (K, B) (an
        executable's first runs are slower). A sample waits in `_samples` until a choice
        reads the estimates (at most KEPT_SAMPLES of them): a held run of bare rounds, which
        asks no choice, costs the worker an append a round, not the estimates' upkeep
        (`scripts/spec_policy_host_time.py`: 1.5 µs a call against 5.6 on its simulated
        state)."""
        self._count_probe(k, b, now, tokens)
        self._run = self._run + 1 if self._last is not None and self._last[:2] == (k, b) else 0
        if self._run >= (SETTLE if k == 0 else 1):
            if self._warm[(k, b)] >= WARM_ROUNDS:
                seconds = max(now - self._last[2], 1e-9)
                if self.adaptive and (k or not bare):  # bare rounds never start a run
                    seconds = self._steadied(k, b, seconds)
                self._samples.append((k, b, seconds, self._round, bare))
                if len(self._samples) >= KEPT_SAMPLES:
                    self.take_samples()
            self._warm[(k, b)] += 1
        self._last = (k, b, now)

    def _steadied(self, k: int, b: int, seconds: float) -> float:
        """A round's seconds as a steady one's: a round r < STINT rounds into a run of its
        drafting K (of 0 with the upkeep: STINT_ZERO) is divided by how much slower such
        rounds are at this B (the median, over the last PAIRS of them, of their seconds over
        their K's steady median, drafting Ks pooled; none before MIN_SAMPLES). A drafting K
        without that at its B takes the nearest B's: a B at which no drafting K runs STINT
        rounds (rounds of 0 and probes) has no factor of its own, and its probes' rounds, all
        early in a run, timed the demo's DFlash K = 8 at B = 4 at 18.4 ms where its fixed
        process's rounds took ~15.7. Rounds of 0 take only their own B's (their slowing
        differs by B)."""
        r = self._run
        if r >= (STINT if k else STINT_ZERO):
            _window(self._steady, (k, b), WINDOW).append(seconds)
            return seconds
        steady = self._steady.get((k, b))
        table = self._slow if k else self._slow_zero
        slow = _window(table, (b, r), PAIRS)
        if steady is not None and len(steady) >= MIN_SAMPLES:
            slow.append(seconds / _median(steady))
        # no run of a drafting K this long at B: the nearest B's
        if k and len(slow) < MIN_SAMPLES:
            slow = min(((abs(other - b), s) for (other, at), s in self._slow.items()
                        if at == r and len(s) >= MIN_SAMPLES),
                       key=lambda x: x[0], default=(0, slow))[1]
        return seconds / _median(slow) if len(slow) >= MIN_SAMPLES else seconds

    def _count_probe(self, k: int, b: int, now: float, tokens: int) -> None:
        """Adds a landed round to the probe being measured; after the SETTLE rounds of another
        K that follow the probe's, records its loss. A probe interrupted (another unit ran, the
        batch changed) is not measured, and its rounds still to come are dropped: run later,
        after a change, they would measure nothing (a probe of the largest K at B = 4 of the
        demo's DFlash, interrupted by a turn's end, took ~15 ms a round at the next turn)."""
        p = self._probing
        if p is None:
            return
        if (self._last is None or self._last[1] != b) and b == p.b and k == p.k \
                and not p.tokens:  # its first round, after another unit ran (a turn's first
            # round after its prefills): it runs on, this round timed as one of K at B
            self.take_samples()
            t = self._time(k, b)
            if t is None:
                self._probing = None
            else:
                p.seconds, p.tokens = t, tokens
            return
        if self._last is None or b != p.b:
            self._probing = None
            if self._plan.get(p.b, (None,))[0] == p.k:
                del self._plan[p.b]
            return
        p.seconds += now - self._last[2]
        p.tokens += tokens
        if k != p.k:
            p.settle -= 1
            if not p.settle:
                lost = (p.seconds - p.tokens / max(p.rate, 1e-12)) / max(p.round_s, 1e-12)
                _window(self._probe_lost, (p.k, b), PROBE_MEMORY).append(lost)
                self._probing = None

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
        self._cum = None
        for i in range(min(k, limit - 1)):
            self._cum_attempted[i] += 1
            self._cum_accepted[i] += produced > i + 1
        # a request's opening rounds, and a probe's (its rounds come when the budget says, not
        # when the text is predictable; without them a run of requests that open with rounds
        # of 0 never updates it): what a request of which nothing is known expects
        opening = acceptance.age <= OPENING or (
            self._probing is not None and k == self._probing.k)
        if opening:  # the prior forgets by rows counted, not by time
            self._prior = None
            self._attempted = [x * DECAY for x in self._attempted]
            self._accepted = [x * DECAY for x in self._accepted]
        for i in range(min(k, limit - 1, produced)):  # reached: drafts 0..i-1 were right
            right = produced > i + 1
            if opening:
                self._attempted[i] += 1.0
                self._accepted[i] += right
            acceptance.attempted[i] += 1
            acceptance.accepted[i] += right

    def stats(self, bare_rounds: int = 0):
        """`bare_rounds`: the Program's count (`ProgramStats.bare_rounds`). `round_ms`: the
        estimates as `take_samples` left them (KEPT_SAMPLES samples late at most), rebuilt for
        a new (K, B) at once and for a changed time KEPT_SAMPLES rounds after the last rebuild
        (rebuilt every round, they took 30-35 µs of the worker's CPU a drafting round at B = 1,
        the demo's DFlash)."""
        from ninfer_jax.engine.spec_stats import SpeculativeStats

        if self._cum is None:
            self._cum = tuple(a / n if n else 0.0 for a, n in zip(self._cum_accepted,
                                                                  self._cum_attempted))
        if self._round_ms is None or (self._round_ms_stale
                                      and self._round - self._round_ms_at >= KEPT_SAMPLES):
            self._round_ms_stale, self._round_ms_at = False, self._round
            self._round_ms = tuple(sorted((k, b, round(1e3 * t, 3))
                                          for (k, b), t in self._typical.items()))
        return SpeculativeStats(
            method=self.method, num_speculative_tokens=self.kmax, verify_rows=self.rows,
            committed_tokens=self.tokens,
            mean_accepted_tokens=self.tokens / self.rows if self.rows else 0.0,
            acceptance_by_position=self._cum, policy="adaptive" if self.adaptive else "fixed",
            rounds_by_drafts=tuple(sorted(self.rounds_by_k.items())),
            estimated_gain=self._gain[0] / self._gain[1] if self._gain[1] else 0.0,
            round_ms=self._round_ms, bare_rounds=bare_rounds)
