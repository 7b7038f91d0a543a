"""The draft policy on simulated rounds: a clock, a round time per (K, B) and rows whose drafts
are right with a known chance. Over a long run its tokens per second come within a few percent
of the best fixed K's (0 included) wherever that is, it explores every compiled K first, it
probes larger K while a smaller one wins (so a text that becomes predictable is noticed), and
it never picks a K whose executable is not ready or drafts for rows that asked for none."""

from __future__ import annotations

import collections
import itertools
import math
import types

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from ninfer_jax.engine.rounds import Rounds
from ninfer_jax.engine.spec_policy import (
    KEPT_SAMPLES,
    MIN_SAMPLES,
    NEAR,
    PROBE_BUDGET,
    PROBE_BUDGET_FAR,
    PROBE_MEMORY,
    REFRESH,
    REFRESH_DRAFTING,
    REFRESH_FAR,
    SETTLE,
    STINT,
    UPKEEP,
    WARM_ROUNDS,
    WINDOW,
    DraftPolicy,
    RowAcceptance,
    RowOutlook,
    _typical,
)
from ninfer_jax.program.limits import ProgramLimits

KS = (0, 1, 2, 3)


def _simulate(policy: DraftPolicy | int, cost, accept: float, rounds: int, b: int = 1,
              seed: int = 0, accept_after: float | None = None) -> tuple[float, list[int]]:
    """Tokens per simulated second over `rounds` rounds of B rows (each row's draft i right
    with chance `accept` given the ones before; `accept_after` from the middle on);
    `policy` a DraftPolicy or a fixed K. cost(k, b): a round's seconds."""
    rng = np.random.default_rng(seed)
    now, tokens, chosen = 0.0, 0, []
    rows = [RowAcceptance(max(KS)) for _ in range(b)]
    for i in range(rounds):
        p = accept if accept_after is None or i < rounds // 2 else accept_after
        outlook = [RowOutlook(a, 10**6) for a in rows]
        k = policy if isinstance(policy, int) else policy.choose(outlook, lambda k, b: True)
        if not isinstance(policy, int):
            policy.dispatched(k, outlook)
        now += cost(k, b)
        round_tokens = 0
        for a in rows:
            produced = 1
            while produced <= k and rng.random() < p:
                produced += 1
            tokens += produced
            round_tokens += produced
            if not isinstance(policy, int):
                policy.add_row(a, k, k + 1, produced, produced)
        if not isinstance(policy, int):
            policy.round_done(k, b, now, round_tokens)
        chosen.append(k)
    return tokens / now, chosen


def _cost(base: float, per_draft: float):
    return lambda k, b: b * (base + (k > 0) * per_draft * (1 + k))


@settings(max_examples=25, deadline=None)
@given(per_draft=st.sampled_from([0.1, 0.4, 1.0, 2.5]),
       accept=st.sampled_from([0.1, 0.5, 0.8, 0.95]),
       b=st.sampled_from([1, 4]))
def test_the_policy_comes_near_the_best_fixed_k(per_draft, accept, b):
    cost = _cost(1.0, per_draft)
    best = max(_simulate(k, cost, accept, 4000, b)[0] for k in KS)
    got, _ = _simulate(DraftPolicy(KS, "mtp"), cost, accept, 4000, b)
    assert got >= 0.93 * best, (got, best)


def test_it_explores_every_k_then_settles_and_probes_in_pairs():
    policy = DraftPolicy(KS, "mtp")
    _, chosen = _simulate(policy, _cost(1.0, 1.0), 0.2, 6000)  # drafts lose: K = 0 wins
    # the largest first; each K runs until it has MIN_SAMPLES steady rounds past its first
    # (the change; SETTLE for a chain of rounds of 0) and WARM_ROUNDS more, a drafting K
    # until MIN_SAMPLES of them are STINT or more rounds into its run
    n, nd = 1 + WARM_ROUNDS + MIN_SAMPLES, STINT + MIN_SAMPLES
    explored = 3 * nd + n + SETTLE - 1
    assert chosen[:explored] == [3] * nd + [2] * nd + [1] * nd + [0] * (n + SETTLE - 1)
    tail = chosen[explored:]
    assert tail.count(0) > 0.97 * len(tail)
    starts = [i for i in range(1, len(tail)) if tail[i] and not tail[i - 1]]
    assert len(starts) >= 3
    for i in starts:  # two rounds of one K (the second measures it), then back to 0
        assert tail[i] == tail[i + 1] and tail[i + 2] == 0
    # while 0 is the best, the drafting K of the highest score (here K = 1: each draft adds a
    # round of 0's time and commits 0.2^j tokens), each after two rounds of it could cost
    # PROBE_BUDGET of the time: a round of K takes 1 + K + 1 rounds of 0 and commits
    # sum_j 0.2^j tokens on average, so it loses the difference (measured: 0.84-1.11 of it,
    # the draws moving K = 1's small loss)
    assert [tail[i] for i in starts[:4]] == [1, 1, 1, 1]
    for a, b in itertools.pairwise(starts):
        k = tail[b]
        lost = (k + 2) - sum(0.2**j for j in range(k + 1))
        assert b - a >= 0.8 * 2 * lost / PROBE_BUDGET
    stats = policy.stats()
    assert dict(stats.rounds_by_drafts)[0] == chosen.count(0)
    assert {k for k, _, _ in stats.round_ms} == set(KS)
    assert stats.estimated_gain == pytest.approx(1.0, abs=0.05)  # K = 0 chosen: no gain


def test_while_a_k_that_drafts_is_best_every_third_probe_times_rounds_of_0():
    """Rounds of 0 are what a drafting choice is weighed against; timed only when last
    chosen, their time can stay from a slow stretch for good (the demo's DFlash at B = 1
    drafted K = 4 for 16 turns at 0.8-0.9 of rounds of 0's tokens per second). While a K
    that drafts is best, the probes run the cheapest K, the largest and the oldest in turn."""
    policy = DraftPolicy(KS, "mtp")
    _, chosen = _simulate(policy, _cost(1.0, 0.1), 0.9, 8000)  # K = 3 wins
    tail = chosen[200:]
    assert tail.count(3) > 0.9 * len(tail)
    probes = [tail[i] for i in range(1, len(tail)) if tail[i] != 3 and tail[i - 1] == 3]
    assert len(probes) >= 6
    assert all(0 in probes[i:i + 3] for i in range(len(probes) - 2)), probes


def test_a_choice_of_0_far_from_drafting_is_scored_less_often():
    """Scoring every K anew is host time in every round it runs: a choice of 0 near the
    break-even (drafting would commit ~0.93 of its tokens per second; the row's estimate moves
    across FAR now and then) is made again every REFRESH rounds, one far from it (~0.4) every
    REFRESH_FAR."""
    made = {}
    for name, per_draft, accept in (("near", 0.3, 0.5), ("far", 1.0, 0.2)):
        policy, cost = DraftPolicy(KS, "mtp"), _cost(1.0, per_draft)
        row, rng, now = RowAcceptance(max(KS)), np.random.default_rng(0), 0.0
        choices = set()
        for i in range(3000):
            outlook = [RowOutlook(row, 10**6)]
            k = policy.choose(outlook, lambda k, b: True)
            policy.dispatched(k, outlook)
            produced = 1
            while produced <= k and rng.random() < accept:
                produced += 1
            policy.add_row(row, k, k + 1, produced, produced)
            now += cost(k, 1)
            policy.round_done(k, 1, now, produced)
            made_ = policy._choice.get(1)  # none in a probe's rounds
            if i >= 1000 and k == 0 and made_ is not None:
                choices.add(made_.round)
        assert policy.rounds_by_k[0] > 0.9 * 3000, name
        made[name] = len(choices)
    assert made["far"] <= 1.3 * 2000 / REFRESH_FAR
    assert made["near"] >= 0.6 * 2000 / REFRESH > 2 * made["far"], made


def _drafting_choices(per_draft: float, accept: float) -> tuple[int, int, list[bool]]:
    """Rounds that drafted the choice's K in rounds 200-989 of one row, the choices behind
    them, and for each round of the last ten whose budget (10 - i tokens) is under a whole
    round of the largest K, whether its choice was made that round."""
    policy, cost = DraftPolicy(KS, "mtp"), _cost(1.0, per_draft)
    row, rng, now = RowAcceptance(max(KS)), np.random.default_rng(0), 0.0
    made_at, tail = set(), []
    drafting = 0
    for i in range(1000):
        budget = 10**6 if i < 990 else 1000 - i
        outlook = [RowOutlook(row, budget)]
        k = policy.choose(outlook, lambda k, b: True)
        made = policy._choice.get(1)
        if 200 <= i < 990 and k and made is not None and made.best == k:
            made_at.add(made.round)
            drafting += 1
        elif i >= 990 and 1 < budget <= max(KS) and made is not None:
            tail.append(made.round == policy._round)
        policy.dispatched(k, outlook)
        produced = 1
        while produced <= min(k, budget - 1) and rng.random() < accept:
            produced += 1
        policy.add_row(row, k, min(k + 1, budget), produced, produced)
        now += cost(k, 1)
        policy.round_done(k, 1, now, produced)
    return drafting, len(made_at), tail


def test_a_drafting_choice_far_from_the_break_even_stands_refresh_drafting_rounds():
    """A choice that drafts where it promises 1 + FAR of the cheapest's tokens per second
    (here ~2.4x) is scored anew every REFRESH_DRAFTING rounds while its rows stay the same
    (scoring every K is host time on the critical path between two drafting rounds), and
    every round once a row's budget is under a whole round of it; near the break-even (here
    ~1.1x: drafting chosen in under half the rounds) every round, but where the row's
    estimate reaches 1 + FAR now and then."""
    drafting, made, tail = _drafting_choices(0.1, 0.9)
    assert drafting > 0.9 * 790
    assert drafting / REFRESH_DRAFTING <= made <= 1.3 * drafting / REFRESH_DRAFTING
    assert tail and all(tail), tail
    drafting, made, _ = _drafting_choices(0.18, 0.5)
    assert drafting > 0.3 * 790
    assert made >= 0.9 * drafting


def test_probes_lose_their_budget_with_the_cost_of_a_change():
    """On the Engine a change of K costs more than the steady rounds' times show (a chain of
    rounds of 0 stops and restarts): here a round after a change costs 2 rounds of 0 more. A
    probe's loss is measured, the change back included, so the probes together lose at most
    about their budget of the time (drafting is far from winning here: PROBE_BUDGET_FAR; 1.06
    of it; at PROBE_BUDGET 1.02 of that, and spaced by their estimated loss alone 1.44)."""
    policy = DraftPolicy(KS, "mtp")
    cost, rng = _cost(1.0, 1.0), np.random.default_rng(0)
    row, outlook = RowAcceptance(max(KS)), None
    now = lost = start = 0.0
    last = 0
    for i in range(12000):
        if i == 1000:  # past the exploration: what each round loses against a round of 0
            start = now
        outlook = [RowOutlook(row, 10**6)]
        k = policy.choose(outlook, lambda k, b: True)
        policy.dispatched(k, outlook)
        seconds = cost(k, 1) + 2.0 * (k != last)
        produced = 1
        while produced <= k and rng.random() < 0.2:
            produced += 1
        policy.add_row(row, k, k + 1, produced, produced)
        now += seconds
        policy.round_done(k, 1, now, produced)
        if i >= 1000:
            lost += seconds - produced * cost(0, 1)
        last = k
    assert 0 < lost <= 1.2 * PROBE_BUDGET_FAR * (now - start), lost / (now - start)


def test_a_text_that_becomes_predictable_is_noticed():
    """Drafts are wrong for the first half (K = 0 wins), then almost always right: the
    probes find it and the policy climbs to the largest K."""
    policy = DraftPolicy(KS, "mtp")
    _, chosen = _simulate(policy, _cost(1.0, 0.3), 0.05, 1600, accept_after=0.97)
    assert chosen[700:800].count(0) > 80
    assert chosen[-200:].count(3) > 180


def test_a_probe_interrupted_by_a_change_of_batch_is_dropped():
    """A probe's first round lands, then a round of another B (a request ended): the probe
    is not measured, and the next round at its B is not the rest of it."""
    policy = DraftPolicy(KS, "mtp")
    cost = _cost(1.0, 1.0)
    rows = [RowAcceptance(max(KS)) for _ in range(2)]
    now, k = 0.0, 0
    for i in range(5000):  # past the exploration (drafts lose: K = 0), until a probe starts
        outlook = [RowOutlook(a, 10**6) for a in rows]
        k = policy.choose(outlook, lambda k, b: True)
        policy.dispatched(k, outlook)
        now += cost(k, 2)
        policy.round_done(k, 2, now, 2)
        if k and i > 100:
            break
    assert k, "no probe in 5000 rounds"
    one = [RowOutlook(rows[0], 10**6)]
    policy.dispatched(policy.choose(one, lambda k, b: True), one)
    policy.round_done(0, 1, now + cost(0, 1), 1)
    assert policy.choose([RowOutlook(a, 10**6) for a in rows], lambda k, b: True) == 0


def _requests_until_drafting(seed: int, switch: int = 2, tokens: int = 128) -> int:
    """B = 1 requests of `tokens` tokens one after another (a prefill between them), drafts
    right with chance 0.1 in the first `switch`, 0.97 after: the first request after the
    switch that drafts in most of its rounds."""
    rng = np.random.default_rng(seed)
    policy, cost, now = DraftPolicy(KS, "mtp"), _cost(1.0, 0.3), 0.0
    for request in range(40):
        p = 0.1 if request < switch else 0.97
        row, budget, drafting, rounds = RowAcceptance(max(KS)), tokens, 0, 0
        while budget > 0:
            outlook = [RowOutlook(row, budget)]
            k = policy.choose(outlook, lambda k, b: True)
            policy.dispatched(k, outlook)
            now += cost(k, 1)
            produced = 1
            while produced <= min(k, budget - 1) and rng.random() < p:
                produced += 1
            policy.round_done(k, 1, now, produced)
            policy.add_row(row, k, min(k + 1, budget), produced, produced)
            budget, drafting, rounds = budget - produced, drafting + (k > 0), rounds + 1
        policy.interrupt()  # the next request's prefill
        if request >= switch and drafting > rounds / 2:
            return request
    return 40


def test_probes_teach_the_prior_what_new_requests_expect():
    """Requests that open with rounds of 0 add nothing to the prior from their openings; the
    probes in them do (their timing does not follow the text): after the text becomes
    predictable, new requests draft from the 4th or so (counted from openings alone, the 7th
    or later: 9, 7, 8, 6 over these seeds)."""
    firsts = [_requests_until_drafting(seed) for seed in range(4)]
    assert np.mean(firsts) <= 5, firsts


def _drafts_land(policy: DraftPolicy, rng, rows: list, stale: list[int], k: int, bare: bool,
                 accept: float) -> int:
    """A round of K lands: each row's drafts are right with chance `accept` unless its context
    is stale (then none is); counts them and marks a bare round's rows stale for the window.
    Returns the round's tokens."""
    tokens = 0
    for r, acceptance in enumerate(rows):
        produced = 1
        while produced <= k and not stale[r] and rng.random() < accept:
            produced += 1
        tokens += produced
        policy.add_row(acceptance, k, k + 1, produced, produced)
        stale[r] = policy.window if bare else max(stale[r] - produced, 0)
    return tokens


def _simulate_bare(policy: DraftPolicy, cost, accept: float, rounds: int, b: int = 1,
                   accept_after: float | None = None, saving: float = 0.05
                   ) -> tuple[float, list[int | str]]:
    """`_simulate` with bare rounds: a round of 0 the policy allows to be bare costs `saving`
    less and leaves its rows' drafter contexts stale for `policy.window` rounds, during which
    their drafts are all wrong (the context a block would read lacks the recent positions).
    Returns the tokens per second and each round's K ("bare" for a bare one)."""
    rng = np.random.default_rng(0)
    now, tokens, chosen = 0.0, 0, []
    rows = [RowAcceptance(max(KS)) for _ in range(b)]
    stale = [0] * b
    for i in range(rounds):
        p = accept if accept_after is None or i < rounds // 2 else accept_after
        outlook = [RowOutlook(a, 10**6, n) for a, n in zip(rows, stale)]
        k = policy.choose(outlook, lambda k, b: True)
        bare = k == 0 and policy.bare(outlook)
        policy.dispatched(k, outlook, bare)
        now += cost(k, b) * (1 - saving * bare)
        round_tokens = _drafts_land(policy, rng, rows, stale, k, bare, p)
        tokens += round_tokens
        policy.round_done(k, b, now, round_tokens, bare)
        chosen.append("bare" if bare else k)
    return tokens / now, chosen


@pytest.mark.parametrize("b", [1, 4])
def test_rounds_of_0_are_bare_where_drafting_loses_and_never_before_a_probe(b):
    """Drafts lose (K = 0 wins): nearly every round of 0 skips the drafter's upkeep, but the
    W rounds before each probe keep it (no probe drafts from a stale context); the first bare
    round comes W rounds after the exploration's last drafting round, but a probe's rounds
    leave the run of 0s standing (bare again once the probe is measured); and the policy runs
    faster than rounds of 0 with the upkeep."""
    window = 16
    policy = DraftPolicy(KS, "dflash", window=window)
    cost = _cost(1.0, 1.0)
    got, chosen = _simulate_bare(policy, cost, 0.2, 6000, b)
    tail = chosen[1000:]
    assert tail.count("bare") > 0.9 * len(tail)
    probes = [i for i in range(1, len(chosen)) if chosen[i] not in (0, "bare")
              and chosen[i - 1] in (0, "bare")]
    assert len(probes) >= 3
    for i in probes[1:]:  # after the exploration: W rounds of upkeep before each
        assert chosen[i - window:i] == [0] * window
    first = chosen.index("bare")
    assert chosen[first - window:first] == [0] * window
    assert all(k in (0, "bare") for k in chosen[first:probes[0]])
    for i in probes:
        end = next(j for j in range(i, len(chosen)) if chosen[j] in (0, "bare"))
        assert "bare" in chosen[end:end + SETTLE + 1], chosen[i:end + SETTLE + 1]
    assert got > _simulate(0, cost, 0.2, 6000, b)[0]
    assert DraftPolicy(KS, "dflash").bare([RowOutlook(RowAcceptance(3), 50)]) is False


class _HoldChecked(DraftPolicy):
    """A policy that checks `holds`: after a bare round, the rounds it promises are bare
    rounds of 0 when asked."""

    held = checked = 0
    last_bare = False

    def choose(self, rows, ready, refill=False, filling=False):
        k = super().choose(rows, ready, refill, filling)
        self.last_bare = False
        if self.held:
            assert k == 0
            self.checked += 1
        return k

    def bare(self, rows, refill=False):
        self.last_bare = super().bare(rows, refill)
        assert self.last_bare or not self.held
        return self.last_bare

    def dispatched(self, k, rows, bare=False):
        super().dispatched(k, rows, bare)
        if self.held:
            self.held -= 1
        elif k == 0 and self.last_bare:
            self.held = self.holds(len(rows))


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("per_draft,accept", [(1.0, 0.2), (0.5, 0.5), (0.3, 0.7)])
def test_the_rounds_a_bare_round_holds_are_bare_rounds_of_0(b, per_draft, accept):
    """`holds` never promises a round the policy would not make a bare round of 0 (so
    `Rounds.chain_plan` may skip asking), and where drafting loses it covers most rounds."""
    policy = _HoldChecked(KS, "dflash", window=16)
    _, chosen = _simulate_bare(policy, _cost(1.0, per_draft), accept, 3000, b)
    if per_draft == 1.0:
        assert policy.checked > 0.5 * len(chosen)
    assert policy.checked <= chosen.count("bare")


def _simulate_rounds(cost, accept: float, rounds: int, b: int) -> list[int | str]:
    """`_simulate_bare`'s rounds planned as the Engine plans them (`Rounds`): a round after a
    round of 0 chained (`chain_plan`, which may reuse a bare round's plan the policy holds),
    else `plan`. Each round's K ("bare" for a bare one)."""
    window = 16
    rounds_ = Rounds(ProgramLimits(
        max_seq_len=96, page_size=4, total_pages=96, total_slots=4, max_concurrency=4,
        prefill_chunk=8, vocab_size=256, verify_width=KS[-1] + 1, speculative="dflash",
        round_drafts=KS, context_window=window))
    policy = rounds_.policy
    rng = np.random.default_rng(0)
    now, chosen, chained = 0.0, [], False
    sampling = types.SimpleNamespace(speculative="on", max_new_tokens=10**6)
    session = types.SimpleNamespace(tokens_before_control=lambda preview: None)
    records = [types.SimpleNamespace(acceptance=None, sampling=sampling, completion_tokens=0,
                                     seq=i, session=session, request_id=i,
                                     next_mask=lambda: None) for i in range(b)]
    stale = [0] * b
    ready = lambda k, b: True
    for i in range(rounds):
        plan = rounds_.chain_plan(records, ready, False, stale.__getitem__) if chained else None
        if plan is None:
            plan = rounds_.plan(records, {}, ready, False, stale.__getitem__)
        k, bare = plan.drafts, plan.bare
        rounds_.dispatched(types.SimpleNamespace(batch_id=i), k, plan.outlooks, bare)
        chained = k == 0
        now += cost(k, b) * (1 - 0.05 * bare)
        round_tokens = _drafts_land(policy, rng, [r.acceptance for r in records], stale, k,
                                    bare, accept)
        landed = rounds_.landed(types.SimpleNamespace(batch_id=i))
        assert landed[::2] == (k, bare)
        policy.round_done(k, b, now, round_tokens, landed[2])
        chosen.append("bare" if bare else k)
    return chosen


@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("per_draft,accept", [(1.0, 0.2), (0.5, 0.5)])
def test_rounds_planned_by_the_engine_are_the_policys_own(b, per_draft, accept):
    """The Engine's `Rounds` (chained rounds of 0, held bare rounds, a row's stale context
    asked only for a choice that drafts) make the very rounds the policy makes when asked every
    round, while most of them are held rounds that ask it nothing."""
    cost = _cost(1.0, per_draft)
    want = _simulate_bare(DraftPolicy(KS, "dflash", window=16), cost, accept, 2000, b)[1]
    assert _simulate_rounds(cost, accept, 2000, b) == want
    assert want.count("bare") > (0.5 if per_draft == 1.0 else 0.0) * len(want)


@pytest.mark.parametrize("per_draft,accept", [(0.1, 0.3), (0.3, 0.7), (0.5, 0.5),
                                               (1.0, 0.8)])
def test_bare_rounds_never_cost_against_the_upkeep_every_round(per_draft, accept):
    """Near the break-even (drafting wins by a little or loses by a little), where a choice
    that flips to drafting after a bare round waits W rounds for its rows' contexts: the policy
    with bare rounds is at least as fast as the same policy with the upkeep every round."""
    cost = _cost(1.0, per_draft)
    for b in (1, 4):
        bare, _ = _simulate_bare(DraftPolicy(KS, "dflash", window=16), cost, accept, 4000, b)
        kept, _ = _simulate_bare(DraftPolicy(KS, "dflash"), cost, accept, 4000, b)
        assert bare >= 0.99 * kept, (b, bare / kept)


@pytest.mark.parametrize("upkeep, bare", [(None, (0.55, 1.0)), (0.0, (0.0, 0.5))])
def test_a_probe_far_from_winning_pays_the_upkeep_before_it(monkeypatch, upkeep, bare):
    """The demo's DFlash at B = 4: a verify costs ~3.5 rounds of 0 and drafting commits ~0.8
    of 0's tokens per second, while a probe of it loses little (~1.4 rounds). Spaced by that
    alone, probes came every ~140 rounds and the W = 64 rounds of upkeep before each left
    under half the rounds bare; charged what a round of the window was measured to take more
    than a bare one (`upkeep` None: 3% here; 0.0: not charged, and spaced by PROBE_BUDGET as
    near the break-even), most rounds are bare and the policy beats rounds of 0 with the
    upkeep."""
    if upkeep is not None:  # and spaced by the budget of probes near the break-even
        monkeypatch.setattr(DraftPolicy, "upkeep", lambda self, b: upkeep)
        monkeypatch.setattr("ninfer_jax.engine.spec_policy.PROBE_BUDGET_FAR", PROBE_BUDGET)

    def cost(k, b):
        return b * (1.0 + (k > 0) * (2.0 + 0.2 * k))

    policy = DraftPolicy(KS, "dflash", window=64)
    got, chosen = _simulate_bare(policy, cost, 0.8, 6000, 4, saving=0.03)
    tail = chosen[1000:]
    assert bare[0] <= tail.count("bare") / len(tail) <= bare[1]
    if upkeep is None:
        assert got > _simulate(0, cost, 0.8, 6000, 4)[0]


def test_the_upkeep_is_timed_where_bare_rounds_and_rounds_with_it_meet():
    """A probe far from winning is charged the window's upkeep: what rounds of 0 with it took
    more than bare ones at its B, each ratio from a stretch of one kind next to one of the
    other (UPKEEP before MIN_SAMPLES of them); stretches far apart give none."""
    def run(policy, n, bare, seconds, b=2):
        for _ in range(n):
            clock[0] += seconds
            rows = [RowOutlook(None, 10**6)] * b
            policy.dispatched(0, rows, bare)
            policy.round_done(0, b, clock[0], b, bare)

    clock = [0.0]
    policy = DraftPolicy(KS, "dflash", window=16)
    run(policy, 20, True, 1.0)
    policy.take_samples()
    assert policy.upkeep(2) == UPKEEP
    for _ in range(3):
        run(policy, 12, False, 1.08)
        run(policy, 12, True, 1.0)
    policy.take_samples()
    assert len(policy._upkeep[2]) == 6
    assert policy.upkeep(2) == pytest.approx(0.08)

    apart = DraftPolicy(KS, "dflash", window=16)
    run(apart, 20, True, 1.0)
    run(apart, 2 * NEAR + 1, True, 1.0, b=1)  # other rounds between the two stretches
    run(apart, 12, False, 1.08)
    apart.take_samples()
    assert 2 not in apart._upkeep and apart.upkeep(2) == UPKEEP


def _turns_bare(policy: DraftPolicy, cost, accept: float, turns: int, b: int, length: int,
                saving: float = 0.03) -> tuple[float, list[list[int | str]]]:
    """`_simulate_bare` in turns of B fresh rows of `length` tokens each (the benchmark's
    shape: the rows end together; a new row's drafter context is whole after its prefill).
    Returns the tokens per second and each turn's rounds."""
    rng = np.random.default_rng(0)
    now, tokens, out = 0.0, 0, []
    for _ in range(turns):
        rows, stale, done, chosen = [RowAcceptance(max(KS)) for _ in range(b)], [0] * b, 0, []
        while done < length:
            outlook = [RowOutlook(a, length - done, n) for a, n in zip(rows, stale)]
            k = policy.choose(outlook, lambda k, b: True)
            bare = k == 0 and policy.bare(outlook)
            policy.dispatched(k, outlook, bare)
            now += cost(k, b) * (1 - saving * bare)
            # every row's drafts land alike here: the rows advance together
            produced = 1
            while produced <= min(k, length - done - 1) and rng.random() < accept:
                produced += 1
            for r, acceptance in enumerate(rows):
                policy.add_row(acceptance, k, min(k + 1, length - done), produced, produced)
                stale[r] = policy.window if bare else max(stale[r] - produced, 0)
            done += produced
            tokens += b * produced
            policy.round_done(k, b, now, b * produced, bare)
            chosen.append("bare" if bare else k)
        policy.interrupt()  # the next turn's prefills
        out.append(chosen)
    return tokens / now, out


def test_a_probe_pays_no_upkeep_its_rows_cannot_use():
    """Turns of 4 rows of 96 tokens where drafting loses (the spec_policy benchmark at B = 4,
    W = 64): the W rounds of upkeep before a probe were paid wherever its wait ended, and a
    turn whose rows ended first wasted them (and its next probe paid them again). The upkeep
    runs only for rows that live through it and the probe's two rounds, and a probe runs as
    soon as its window begins if its rows' contexts are whole (fresh from their prefills): no
    run of upkeep rounds after a bare one is cut short by a bare round or the turn's end, most
    probes come at a turn's first round, and nearly every other round is bare."""
    def cost(k, b):
        return b * (1.0 + (k > 0) * (2.0 + 0.2 * k))

    policy = DraftPolicy(KS, "dflash", window=64)
    _, turns = _turns_bare(policy, cost, 0.5, 150, 4, 96)
    first = later = 0
    for chosen in turns[5:]:
        upkeep = None  # rounds of 0 with the upkeep since the last bare one
        for i, k in enumerate(chosen):
            if k == "bare":
                assert not upkeep, chosen  # upkeep given up: its rounds paid for nothing
                upkeep = 0
            elif k == 0:
                upkeep = None if upkeep is None else upkeep + 1
            else:
                first += i == 0
                later += i > 0 and chosen[i - 1] != k
                upkeep = None
        assert not upkeep, chosen  # upkeep cut by the turn's end
    assert first >= 3 and first > later, (first, later)
    # a turn's first-round probes are measured too (their first round timed as one of K):
    # unmeasured, their estimated loss spaced them a turn apart
    assert sum(len(lost) for lost in policy._probe_lost.values()) >= min(first, PROBE_MEMORY)
    tail = [k for chosen in turns[5:] for k in chosen]
    assert tail.count("bare") > 0.9 * len(tail)


def test_a_predictable_text_after_bare_rounds_waits_for_its_context_then_drafts():
    """Drafts lose for the first half (bare rounds), then are almost always right: the
    policy notices (its probes run with whole contexts), never drafts while a row's context
    is stale, and climbs to the largest K."""
    policy = DraftPolicy(KS, "dflash", window=16)
    _, chosen = _simulate_bare(policy, _cost(1.0, 0.3), 0.05, 1600, accept_after=0.97)
    assert chosen[700:800].count("bare") > 60
    assert chosen[-200:].count(3) > 180
    rows = [RowOutlook(RowAcceptance(3), 50, 5)]  # a stale row: drafting waits
    assert policy.choose(rows, lambda k, b: True) == 0 and not policy.bare(rows)
    assert policy.bare([RowOutlook(None, 50), RowOutlook(RowAcceptance(3), 1)])


def _windowed_policy(gain: float) -> tuple[DraftPolicy, RowAcceptance]:
    """A DFlash policy with W = 64 whose times at B = 1 are measured (K = 4 committing `gain`
    times the tokens per second of rounds of 0 for a row right 0.9 of the time, its context
    whole), its last round one of 0, and that row's acceptance."""
    policy = DraftPolicy((0, 4), "dflash", window=64)
    a = RowAcceptance(4)
    a.attempted, a.accepted = [1000.0] * 4, [900.0] * 4
    e4 = DraftPolicy._row_expected(RowOutlook(a, 10**6), policy._rates(a, [0.9] * 4))[4]
    for k, t in ((0, 1.0), (4, e4 / gain)):
        policy._ready.add((k, 1))
        for table in (policy._times, policy._steady):
            table[(k, 1)] = collections.deque([t] * 3)
        policy._typical[(k, 1)] = t
    policy._explored.add(1)
    policy._last = (0, 1, 0.0)
    return policy, a


def test_a_choice_for_stale_rows_pays_the_upkeep_before_its_drafts():
    """K = 4 commits 1.15x the tokens per second of rounds of 0 for a row, once its drafter
    context is whole; after bare rounds it first needs W = 64 rounds of 0 with the upkeep. A
    row with 100 tokens left would draft for 36 of them (the demo's DFlash at B = 1 near the
    break-even paid 64 rounds of upkeep again and again for a few rounds of K = 15: 0.86 of
    the same process's requests that drafted nothing): it holds the bare rounds of 0. A row
    with 10,000 left drafts after the upkeep, and a fresh one at once. The Engine asks a row's
    staleness only of a choice that drafts (`Rounds`): the choice made again with it stands
    for the next round's first question (which does not know it)."""
    policy, a = _windowed_policy(1.15)
    ready = lambda k, b: True
    assert policy.choose([RowOutlook(a, 100)], ready) == 4  # fresh from its prefill
    assert policy.choose([RowOutlook(a, 100, stale=64)], ready) == 0
    assert policy._choice[1].best == 0 and policy._choice[1].stale == 64
    assert policy.choose([RowOutlook(a, 100)], ready) == 0  # the standing choice
    policy._choice.clear()
    assert policy.choose([RowOutlook(a, 10**4, stale=64)], ready) == 0  # the upkeep first
    assert policy._choice[1].best == 4


def test_a_choice_made_again_for_stale_rows_keeps_the_probe_whose_upkeep_began():
    """A choice of 0 whose probe's upkeep has begun keeps that probe and its wait. A choice
    made for the same rows without their staleness (`Rounds`' first question), then again
    with it, is the choice made once with it: the probe and its wait stay those of the
    choice before the first."""
    policy, a = _windowed_policy(1.12)
    ready = lambda k, b: True
    a.accepted = [840.0] * 4  # drafting loses by a little: 0, and a probe of 4
    assert policy.choose([RowOutlook(a, 100)], ready) == 0
    before = policy._choice[1]
    policy._since_probe[1] = math.ceil(policy._due_at(before))  # its upkeep has begun
    policy._round += before.stands
    a.accepted = [900.0] * 4  # now K = 4 wins by 12% where the row's context is whole
    assert policy.choose([RowOutlook(a, 100)], ready) == 4
    assert policy.choose([RowOutlook(a, 100, stale=64)], ready) == 0
    made = policy._choice[1]
    assert (made.best, made.probe, made.wait) == (0, 4, before.wait)


def test_rows_that_draft_nothing_and_unready_executables():
    policy = DraftPolicy(KS, "mtp")
    off = [RowOutlook(None, 50), RowOutlook(RowAcceptance(3), 1)]
    assert policy.choose(off, lambda k, b: k == 3) == 3  # only the largest is compiled
    on = [RowOutlook(RowAcceptance(3), 50)]
    assert policy.choose(on, lambda k, b: k == 3) == 3
    for _ in range(50):
        k = policy.choose(on, lambda k, b: k in (2, 3))
        assert k in (2, 3)
        policy.dispatched(k, on)
        policy.round_done(k, 1, 0.0, 1)
    assert policy.choose(off, lambda k, b: True) == 0  # nothing to draft: the cheapest round
    fixed = DraftPolicy((3,), "mtp")
    assert fixed.choose(on, lambda k, b: True) == 3 and fixed.stats().policy == "fixed"


def test_acceptance_counts_only_reached_positions():
    policy, own = DraftPolicy(KS, "mtp"), RowAcceptance(3)
    policy.add_row(own, 3, 4, 2, 2)  # draft 0 right, draft 1 wrong, draft 2 never reached
    policy.add_row(own, 3, 2, 2, 2)  # its limit let it draft one, which was right
    assert (own.attempted, own.accepted) == ([2, 1, 0], [2, 0, 0])
    stats = policy.stats()
    assert (stats.verify_rows, stats.committed_tokens) == (2, 4)
    assert stats.acceptance_by_position == (1.0, 0.0, 0.0)  # unconditional: drafts 0..i right
    policy.add_row(None, 3, 4, 1, 1)  # a row that drafted nothing is not a verify row
    policy.add_row(own, 0, 1, 1, 1)  # nor is a row of a round of no drafts
    assert policy.stats().verify_rows == 2


def test_a_new_batch_size_measures_its_cheapest_round_and_scales_the_rest():
    """After B = 1 explored every K, B = 2 runs rounds of 0 until their time is known and
    takes a drafting K's time there as the least it can be (its time at B = 1, or 0's at
    B = 2): where drafts are rarely right even that loses, and no K that drafts runs at B = 2."""
    policy = DraftPolicy(KS, "mtp")
    cost = _cost(1.0, 1.0)
    _simulate(policy, cost, 0.2, 100, b=1)
    _, chosen = _simulate(policy, cost, 0.2, 100, b=2)
    assert set(chosen) == {0}
    assert policy._time(3, 2) == pytest.approx(cost(3, 1), rel=1e-6)
    assert policy._time(0, 2) == pytest.approx(cost(0, 2), rel=1e-6)


@pytest.mark.parametrize("name, cost, wins", [
    # a verify's extra work grows with its rows while a round of 0's grows less: K = 3 wins
    # at B = 1 and loses at B = 4
    ("drafts grow with the rows", lambda k, b: 1.0 + 0.3 * (b - 1) + (k > 0) * 0.4 * (1 + k) * b,
     False),
    # a round's time is per-operation overhead (the demo model on these cores: the demo's
    # DFlash K = 8 took ~15 ms at B = 4, where scaled from B = 1 by the rows it read ~29 ms
    # and the policy held rounds of 0 while fixed K = 8 ran 1.05-1.22x off's tokens per
    # second): drafting wins at B = 4 too
    ("per-op overhead", lambda k, b: 1.0 + 0.3 * (b - 1) + (k > 0) * (1.0 + 0.2 * k) * (
        1 + 0.15 * (b - 1)), True),
])
def test_a_drafting_k_at_a_new_batch_size_runs_where_it_may_win_until_measured(name, cost, wins):
    """K = 3 wins at B = 1. At B = 4, unmeasured, a drafting K's time is the least it can be
    (its time at B = 1, or 0's at B = 4): it may win, so it runs there until its time is
    measured (a few rounds of each such K, once), then the policy keeps 0 where drafting loses
    and drafts where it wins."""
    policy = DraftPolicy(KS, "mtp")
    _, ones = _simulate(policy, cost, 0.9, 300, b=1)
    assert ones[-50:].count(0) < 10  # drafting wins at B = 1
    _, fours = _simulate(policy, cost, 0.9, 600, b=4)
    tried = 1 + WARM_ROUNDS + MIN_SAMPLES + SETTLE
    assert sum(k != 0 for k in fours[:3 * tried]) >= MIN_SAMPLES  # measured, not scaled
    assert policy._time(3, 4) == pytest.approx(cost(3, 4), rel=0.05)
    best = max(KS, key=lambda k: _simulate(k, cost, 0.9, 600, b=4)[0])
    assert (best != 0) == wins
    if wins:
        assert fours[-300:].count(0) < 30
    else:
        assert sum(k != 0 for k in fours) <= 3 * tried + 10  # then rounds of 0 (probes aside)


def _turns(policy: DraftPolicy | int, cost, accept, turns: int, length: int = 128,
           seed: int = 0, load=None, ks=KS) -> float:
    """What the benchmark measures, in simulated seconds: each request's tokens over the
    seconds to its end, summed over a turn's requests, the mean over `turns` turns; a turn
    runs len(accept) fresh requests of `length` tokens together until the last ends (nothing
    waits: refill is False), row i's drafts right with chance accept[i](position in its
    output) (a float, or one per draft position). cost(k, b): a round's seconds with b rows;
    load(now) (optional): how much slower the machine is at that moment."""
    rng = np.random.default_rng(seed)
    now, speeds = 0.0, []
    for _ in range(turns):
        rows = [[RowAcceptance(max(ks)), 0, p] for p in accept]  # acceptance, produced, chance
        start, speed = now, 0.0
        while live := [r for r in rows if r[1] < length]:
            outlook = [RowOutlook(a, length - n) for a, n, _ in live]
            k = policy if isinstance(policy, int) else policy.choose(outlook, lambda k, b: True)
            if not isinstance(policy, int):
                policy.dispatched(k, outlook)
            now += cost(k, len(live)) * (load(now) if load else 1.0)
            done = 0
            for r in live:
                limit = min(k + 1, length - r[1])
                produced, chance = 1, r[2](r[1])
                while produced < limit and rng.random() < (
                        chance if isinstance(chance, float) else chance[produced - 1]):
                    produced += 1
                r[1] += produced
                done += produced
                if r[1] >= length:
                    speed += length / (now - start)
                if not isinstance(policy, int):
                    policy.add_row(r[0], k, limit, produced, produced)
            if not isinstance(policy, int):
                policy.round_done(k, len(live), now, done)
        speeds.append(speed)
    return sum(speeds) / len(speeds)


def _phases(early: float, late: float):
    return lambda position: early if position < 64 else late


@pytest.mark.parametrize("name, cost, accept, target", [
    # drafting costs several rounds of 0 (these cores): requests that turn predictable halfway
    # (the demo model's stories) and requests that never do; the best fixed K is 0
    ("cpu, phases", lambda k, b: (1 + b) * (1 + 2 * (k > 0) + 0.2 * k),
     [_phases(0.6, 0.97)], 0.97),
    ("cpu, phases, 4 rows", lambda k, b: (1 + b) * (1 + 2 * (k > 0) + 0.2 * k),
     [_phases(0.6, 0.97), _phases(0.5, 0.95), _phases(0.7, 0.9), _phases(0.4, 0.4)], 0.97),
    ("cpu, unpredictable", lambda k, b: (1 + b) * (1 + 2 * (k > 0) + 0.2 * k),
     [_phases(0.5, 0.5)] * 4, 0.97),
    # three rows would gain from drafting, the fourth lags behind them and ends alone: fixed
    # K = 3 gives the rows' speeds 1.08x K = 0's (the turn's end comes about when it would);
    # scoring the rows' work to the last one's end, the policy kept 0.95 of K = 3
    ("cpu, 4 rows, one unpredictable", lambda k, b: (1 + b) * (1 + 1.5 * (k > 0) + 0.2 * k),
     [_phases(0.95, 0.95)] * 3 + [_phases(0.3, 0.3)], 0.97),
    # drafting costs little (a memory-bound device): the largest K wins by far
    ("device, phases", lambda k, b: (4 + b) * (1 + 0.03 * k),
     [_phases(0.8, 0.97)], 0.9),
    ("device, 4 rows, one unpredictable", lambda k, b: (4 + b) * (1 + 0.03 * k),
     [_phases(0.8, 0.97)] * 3 + [_phases(0.3, 0.3)], 0.9),
])
def test_turns_of_fresh_requests_come_near_the_best_fixed_k(name, cost, accept, target):
    """The benchmark's shape: turns of fresh requests run together to the last one's end, whose
    acceptance changes along their output. The policy keeps `target` of the best fixed K (0
    included) over the turns: it backs off where drafting loses and keeps the gain where it
    wins."""
    fixed = {k: _turns(k, cost, accept, 30) for k in KS}
    got = _turns(DraftPolicy(KS, "mtp"), cost, accept, 30)
    assert got >= target * max(fixed.values()), (got, fixed)


def _bursts(now: float) -> float:
    """A shared machine: 2.5x slower for 150 time units out of every 700."""
    return 2.5 if now % 700.0 < 150.0 else 1.0


@pytest.mark.parametrize("name, cost, accept", [
    ("cpu, phases, 4 rows", lambda k, b: (1 + b) * (1 + 2 * (k > 0) + 0.2 * k),
     [_phases(0.6, 0.97), _phases(0.5, 0.95), _phases(0.7, 0.9), _phases(0.4, 0.4)]),
    ("cpu, phases", lambda k, b: (1 + b) * (1 + 2 * (k > 0) + 0.2 * k), [_phases(0.6, 0.97)]),
])
def test_a_busy_machine_does_not_make_drafting_look_cheap(name, cost, accept):
    """Rounds slow down by 2.5x in bursts: rounds of 0 timed in a burst and rounds that draft
    timed outside one made drafting look cheaper than it is, and the policy drafted where no
    fixed K gains. Compared on times taken close together it keeps 0.97 of the best fixed K."""
    fixed = {k: _turns(k, cost, accept, 30, load=_bursts) for k in KS}
    got = _turns(DraftPolicy(KS, "mtp"), cost, accept, 30, load=_bursts)
    assert got >= 0.97 * max(fixed.values()), (got, fixed)


@pytest.mark.parametrize("seed", range(4))
def test_a_burst_does_not_make_a_k_timed_before_it_look_cheap(seed):
    """DFlash's Ks on these cores where drafting loses (the spec_policy benchmark at B = 1
    on 2026-12-07: fixed K = 4 ran 0.66-0.95 of off, rounds of 0 ~0.9 ms, K = 15 ~8.5), on a
    machine with bursts. The largest Ks are timed in the first exploration only and paired
    there with the K they ran after, never with 0: in a burst the rounds of 0 (and the Ks
    paired with them) slowed 2.5x while their times stayed, and the policy drafted K = 8 for
    159 rounds of seed 2 (0.91 of rounds of 0) as the benchmark's did (8 and 15 for 5-14
    rounds of a turn; three such turns ran 0.57-0.76 of off's tokens per second). Timed
    through the chain of pairs that links them to the anchor, they slow with it."""
    ks = (0, 1, 4, 8, 15)
    rates = [0.94, 0.85, 0.82, 0.85, 0.6, 0.85, 0.9, 1.0, 0.4, 0.5] + [0.9] * 5

    def cost(k, b):
        return (1 + b) * 0.5 * (0.9 if k == 0 else 3.2 + 0.36 * k)

    accept = [lambda position: rates]
    fixed = {k: _turns(k, cost, accept, 30, load=_bursts, seed=seed, ks=ks) for k in ks}
    got = _turns(DraftPolicy(ks, "dflash"), cost, accept, 30, load=_bursts, seed=seed, ks=ks)
    assert max(fixed, key=fixed.get) == 0
    assert got >= 0.97 * fixed[0], (got, fixed)


class _TailedZeros:
    """Rounds of 0 that take 1 but every fourth 2.6 (a host stall in a short round: mean 1.4,
    median 1); rounds that draft take 3.2 + 0.2 K every time."""

    def __init__(self):
        self.zeros = 0

    def __call__(self, k: int, b: int) -> float:
        if k:
            return 3.2 + 0.2 * k
        self.zeros += 1
        return 2.6 if self.zeros % 4 == 0 else 1.0


def test_a_round_is_timed_by_what_its_tail_costs_too():
    """Rounds of 0 whose median says they win and whose mean says they lose (the demo's DFlash
    at B = 1: rounds of 0 have the heavier tail): the policy drafts and keeps 0.95 of the best
    fixed K (0.985); timed by medians it kept to rounds of 0, 0.80 of it."""
    fixed = {k: _turns(k, _TailedZeros(), [_phases(0.9, 0.9)], 30) for k in KS}
    assert max(fixed, key=fixed.get) == 3 and fixed[3] > 1.2 * fixed[0], fixed
    got = _turns(DraftPolicy(KS, "mtp"), _TailedZeros(), [_phases(0.9, 0.9)], 30)
    assert got >= 0.95 * fixed[3], (got, fixed)


def test_waiting_requests_make_the_round_count_and_none_each_rows_speed():
    """Three rows whose drafts are nearly always right and one whose are not: with requests
    waiting (a row that ends is replaced) the round's tokens per second count, and K = 3's
    are within MARGIN of K = 0's; with none, each row's own speed to its end does: three rows
    end in a third of the time, the fourth then runs alone in cheap rounds, and K = 3 wins."""
    policy = DraftPolicy(KS, "mtp")
    cost = lambda k, b: (4 + b) * (1 + 1.5 * (k > 0) + 0.2 * k)  # a round costs more than its rows
    for k, b in itertools.product(KS, range(1, 5)):
        policy._ready.add((k, b))
        for _ in range(3):
            policy._times.setdefault((k, b), collections.deque()).append(cost(k, b))
            policy._steady.setdefault((k, b), collections.deque()).append(cost(k, b))
        policy._typical[(k, b)] = cost(k, b)
    rows = []
    for right in (True, True, True, False):
        a = RowAcceptance(max(KS))
        a.attempted, a.accepted = [50.0] * 3, [50.0 * (0.97 if right else 0.3)] * 3
        rows.append(RowOutlook(a, 100))
    assert policy.choose(rows, lambda k, b: True, refill=True) == 0
    policy._choice.clear()
    assert policy.choose(rows, lambda k, b: True, refill=False) == 3


def _measured_policy(held: int) -> tuple[DraftPolicy, RowOutlook]:
    """A policy whose times at B = 1 are measured (K = 7 promising 3% more tokens per second
    than K = 3, both far more than 0), its last round of K = `held`, and a row for it."""
    policy = DraftPolicy((0, 3, 7), "dflash")
    a = RowAcceptance(7)
    a.attempted, a.accepted = [1000.0] * 7, [900.0] * 7
    rates = policy._rates(a, [0.9] * 7)
    expected = {k: DraftPolicy._row_expected(RowOutlook(a, 10**6), rates)[k] for k in (0, 3, 7)}
    cost = {0: 1.5, 3: 3.0}
    cost[7] = expected[7] / (1.03 * expected[3] / cost[3])
    for k in (0, 3, 7):
        policy._ready.add((k, 1))
        policy._times[(k, 1)] = collections.deque([cost[k]] * 3)
        policy._steady[(k, 1)] = collections.deque([cost[k]] * 3)
        policy._typical[(k, 1)] = cost[k]
    policy._explored.add(1)
    policy._last = (held, 1, 0.0)
    return policy, RowOutlook(a, 10**6)


@pytest.mark.parametrize("held, chosen", [(3, 3), (7, 7), (0, 7)])
def test_a_drafting_k_changes_to_another_only_for_switch_more(held, chosen):
    """K = 7 promises 3% more tokens per second than K = 3 (under SWITCH): after a round of 3
    the policy keeps 3, after a round of 7 it keeps 7, after a round of 0 it takes the best."""
    policy, row = _measured_policy(held)
    assert policy.choose([row], lambda k, b: True) == chosen


def test_while_the_batch_fills_the_round_is_the_cheapest():
    """Drafting wins for the row, but a waiting request may be admitted next: the round of 0
    (it admits that request sooner); with requests waiting and no room, the round's K."""
    policy, row = _measured_policy(0)
    assert policy.choose([row], lambda k, b: True, refill=True, filling=True) == 0
    assert policy.choose([row], lambda k, b: True, refill=True, filling=False) == 7


# the demo's DFlash round times at B = 1 on these cores (ms, steady; measured on the Program)
_STEADY = {0: 1.0, 1: 2.1, 3: 2.55, 7: 3.25, 15: 5.2}


class _Switching:
    """_STEADY's round times slowed by a change of K: a round right after a change takes 1.4x,
    0.6x of the excess left each round after (measured on the Program: K = 7 after K = 3 took
    4.3, 3.9, 3.75, 3.4 ms, then 3.3 steady)."""

    def __init__(self):
        self.last, self.run = None, 0

    def __call__(self, k: int, b: int) -> float:
        self.run = self.run + 1 if k == self.last else 0
        self.last = k
        return b * _STEADY[k] * (1.0 + 0.4 * 0.6**self.run)


def test_rounds_early_in_a_run_of_their_k_are_timed_as_steady_ones():
    """After a change of K rounds are slower (`_Switching`), and a K the policy does not hold
    runs only such rounds (probes: two at a time). Timed as they come, K = 7 run two rounds
    at a time among runs of K = 3 took 1.24x its steady time; divided by how much slower the
    rounds early in a run are than steady ones (measured on any K), its time and K = 3's
    come within 3% of the steady ones."""
    policy = DraftPolicy((0, 3, 7), "dflash")
    clock, now = _Switching(), 0.0
    rows = [RowOutlook(RowAcceptance(7), 10**6)]
    for k in [7] * 12 + [3] * 12 + ([3] * 20 + [7] * 2) * 12:
        policy.dispatched(k, rows)
        now += clock(k, 1)
        policy.round_done(k, 1, now, k + 1)
    assert policy._time(7, 1) == pytest.approx(_STEADY[7], rel=0.03)
    assert policy._time(3, 1) == pytest.approx(_STEADY[3], rel=0.03)


class _SlowZeros:
    """_STEADY's round times with rounds of 0 slowed after a change for longer than drafting
    rounds are: 1.4x right after it, 0.85x of the excess left each round after (the demo's
    DFlash at B = 1 through the Engine: rounds of 0 after three of K = 4 or 8 took 1.30-1.52
    ms in the 2nd-6th rounds of their run, 1.15-1.25 from the 12th)."""

    def __init__(self):
        self.last, self.run = None, 0

    def __call__(self, k: int, b: int) -> float:
        self.run = self.run + 1 if k == self.last else 0
        self.last = k
        return b * _STEADY[k] * (1.0 + (k == 0) * 0.4 * 0.85**self.run)


@pytest.mark.parametrize("last", [0, 3])
def test_rounds_of_0_early_in_their_run_are_timed_as_steady_ones(last):
    """A policy that drafts runs rounds of 0 only a few at a time (probes of the cheapest
    round: SETTLE + MIN_SAMPLES), all early in their run. Timed as they come they read ~25%
    over steady rounds of 0, as themselves (the last rounds were 0) and through their pairs
    with the drafting K (the last were K = 3), and a drafting K near its break-even looks
    better than it is. Divided by how much slower such rounds were than the rounds of 0
    STINT_ZERO or more into a run at that B, they come within 3% of the steady time."""
    policy = DraftPolicy((0, 3, 7), "dflash")
    clock, now = _SlowZeros(), 0.0
    rows = [RowOutlook(RowAcceptance(7), 10**6)]
    for k in [0] * 40 + ([3] * 20 + [0] * (SETTLE + MIN_SAMPLES)) * 12 + [3] * 3 * (last == 3):
        policy.dispatched(k, rows)
        now += clock(k, 1)
        policy.round_done(k, 1, now, k + 1)
    policy.take_samples()
    assert policy._anchor(1) == last
    assert policy._time(0, 1) == pytest.approx(_STEADY[0], rel=0.03)


def test_a_b_without_long_runs_of_a_drafting_k_steadies_its_rounds_as_the_nearest_b():
    """At B = 4 the policy runs rounds of 0 and probes of K = 7 two rounds at a time: no
    drafting K runs long enough there to measure how much slower a run's first rounds are.
    They are steadied by B = 1's (as the demo's DFlash at B = 4, whose K = 8 the policy
    timed at 18.4 ms where fixed K = 8's rounds took ~15.7: the policy held rounds of 0)."""
    policy = DraftPolicy((0, 3, 7), "dflash")
    clock, now = _Switching(), 0.0
    for b, ks in ((1, [7] * 12 + [3] * 12 + ([3] * 20 + [7] * 2) * 6),
                  (4, [0] * 12 + ([0] * 20 + [7] * 2) * 12)):
        rows = [RowOutlook(RowAcceptance(7), 10**6)] * b
        for k in ks:
            policy.dispatched(k, rows)
            now += clock(k, b)
            policy.round_done(k, b, now, b * (k + 1))
    assert not any(len(s) for (b, _), s in policy._slow.items() if b == 4)
    assert policy._time(7, 4) == pytest.approx(4 * _STEADY[7], rel=0.03)


# acceptance by draft position (conditional) with which K = 7 commits 1.15x the tokens per
# second of K = 3, as it does on the demo's first story prompt at B = 1 (1,340-1,370 tok/s
# against 1,170-1,200 through the Engine, a K forced)
_STORY = (0.9, 0.8, 0.7, 0.85, 0.85, 0.94, 0.89, 0.96) + (0.5,) * 7


@pytest.mark.xfail(strict=True, reason="known limit ([spec-policy]): 0.90-0.93 of the best "
                   "fixed K over seeds 0-3 (docs/speculative.md)")
def test_a_change_of_k_slowing_its_first_rounds_does_not_hide_the_best_k():
    """A round right after a change of K is slower than steady ones (the demo's DFlash at B = 1
    on these cores); explorations and probes run few rounds of a K, all near a change. The
    best fixed K here is 7 (it commits 1.15x K = 3's tokens per second, as on the demo's first
    story prompt); the policy should keep 0.95 of it on every seed. It does not: it runs
    rounds of 0 for hundreds of rounds at a time, from its prior's acceptance of few rows
    (drafts 0-2 0.80, 0.74, 0.64 after the exploration against 0.9, 0.8, 0.7; rounds of 0
    add no counts, probes come a few hundred rounds apart; a request whose first drafts were
    unlucky holds to rounds of 0 for its whole length), and flips between K = 3 and 7 near
    their break-even. Its times are the steady ones (`_steadied`)."""
    ks = tuple(_STEADY)
    for seed in range(4):
        fixed = {k: _turns(k, _Switching(), [lambda n: _STORY], 30, ks=ks, seed=seed)
                 for k in ks}
        got = _turns(DraftPolicy(ks, "dflash"), _Switching(), [lambda n: _STORY], 30, ks=ks,
                     seed=seed)
        assert max(fixed, key=fixed.get) == 7
        assert got >= 0.95 * max(fixed.values()), (seed, got / max(fixed.values()))


class _CheckedPolicy(DraftPolicy):
    """Before each choice: every kept ratio equals one computed afresh from the pairs, and the
    cheap test for an estimate agrees with the estimate."""

    def choose(self, rows, ready, refill=False):
        for key, ratio in self._ratios.items():
            assert ratio == self._paired_ratio(*key), key
        for k, b in itertools.product(self.ks, range(1, 5)):
            assert self._estimated(k, b) == (self._time(k, b) is not None), (k, b)
        return super().choose(rows, ready, refill)


def test_kept_estimates_equal_fresh_ones():
    """`choose` runs every round, so the paired ratios are kept until a pair of their two Ks
    comes; on turns of 1 and 4 rows with bursts of load none of them is ever stale."""
    cost = lambda k, b: (1 + b) * (1 + 2 * (k > 0) + 0.2 * k)
    policy = _CheckedPolicy(KS, "mtp")
    for accept in ([_phases(0.6, 0.97)], [_phases(0.9, 0.9)] * 4, [_phases(0.6, 0.97)]):
        _turns(policy, cost, accept, 6, load=_bursts)
    assert policy._ratios and sum(policy.rounds_by_k[k] for k in KS[1:]) > 0


def _take_each(policy: DraftPolicy) -> None:
    """The policy's kept samples added one by one, each paired with every other K's samples
    of the NEAR rounds before it, and a round of 0 added to its stretch of bare rounds or
    rounds with the upkeep: `take_samples` without its shortcuts."""
    for sample in policy._samples:
        k, b, seconds, at, _ = sample
        if policy.adaptive:
            policy._pair(k, b, seconds, at)
        if k == 0 and policy.window:
            policy._take_stretches(b, [sample])
        policy._times.setdefault((k, b), collections.deque(maxlen=WINDOW)).append(seconds)
        policy._at.setdefault((k, b), collections.deque(maxlen=WINDOW)).append(at)
        policy._measured[(k, b)] = at
        policy._typical[(k, b)] = _typical(policy._times[(k, b)])
        policy._round_ms = None
    policy._samples.clear()


@settings(max_examples=30, deadline=None)
@given(runs=st.lists(st.tuples(st.sampled_from(KS), st.sampled_from([1, 2, 4]),
                               st.integers(1, 40), st.booleans()), min_size=1, max_size=12),
       seed=st.integers(0, 2**16), adaptive=st.booleans())
@example(runs=[(3, 1, 20, False), (1, 1, 12, False), (2, 1, 6, False), (0, 1, 40, True),
               (2, 4, 9, False), (0, 4, 30, False)], seed=0,
         adaptive=True)  # runs right after two other Ks, one of them long ago
@example(runs=[(0, 4, 20, True), (0, 4, 12, False), (2, 4, 2, False), (0, 4, 9, True),
               (0, 4, 6, False)], seed=0, adaptive=True)  # stretches of bare rounds and not
def test_kept_samples_give_the_estimates_taken_at_once(runs, seed, adaptive):
    """Round times wait in the policy until a choice reads them (a held run of bare rounds
    asks none; at most KEPT_SAMPLES wait): taken late, in runs, they leave every estimate as
    adding each as it landed does (`_take_each`: times, their rounds, pairs, the paired
    ratios, the upkeep's stretches and ratios)."""
    rng = np.random.default_rng(seed)
    ks = KS if adaptive else (3,)
    late, eager = DraftPolicy(ks, "mtp", window=8), DraftPolicy(ks, "mtp", window=8)
    now = 0.0
    for k, b, n, bare in runs:
        k = k if adaptive else 3
        bare = bare and k == 0
        rows = [RowOutlook(None, 10**6)] * b
        for _ in range(n):
            now += (1 + b) * (1 + k) * (1 + 0.3 * rng.random()) * (1 - 0.1 * bare)
            for policy in (late, eager):
                policy.dispatched(k, rows, bare)
                policy.round_done(k, b, now, b, bare)
            _take_each(eager)
        if rng.random() < 0.3:
            for policy in (late, eager):
                policy.interrupt()
    assert len(late._samples) < KEPT_SAMPLES
    late.take_samples()
    for name in ("_times", "_at", "_typical", "_measured", "_pairs", "_warm", "_stretch",
                 "_upkeep"):
        assert getattr(late, name) == getattr(eager, name), name
    for k, j, b in itertools.product(ks, ks, [1, 2, 4]):
        assert late._ratio(k, j, b) == eager._ratio(k, j, b)


def test_stats_show_a_new_round_at_once_and_a_changed_time_within_kept_samples():
    """`stats().round_ms` is not rebuilt every round: a (K, B) first measured shows in the
    next stats, a changed time within KEPT_SAMPLES rounds of the last rebuild."""
    policy, now, rows = DraftPolicy(KS, "mtp"), 0.0, [RowOutlook(None, 10**6)]

    def rounds(k: int, n: int, seconds: float) -> None:
        nonlocal now
        for _ in range(n):
            policy.dispatched(k, rows)
            now += seconds
            policy.round_done(k, 1, now, 1)
        policy.take_samples()

    rounds(0, 10, 1.0)
    assert [ms for k, _, ms in policy.stats().round_ms if k == 0] == [1000.0]
    rounds(0, 12, 2.0)  # the window's times all 2.0 now: shown late
    assert [ms for k, _, ms in policy.stats().round_ms if k == 0] == [1000.0]
    rounds(1, 5, 3.0)  # a new (K, B): at once, with every time as it is now
    assert sorted(policy.stats().round_ms) == [(0, 1, 2000.0), (1, 1, 3000.0)]
    rounds(0, 10, 4.0)
    assert (0, 1, 2000.0) in policy.stats().round_ms
    rounds(0, KEPT_SAMPLES, 4.0)
    assert (0, 1, 4000.0) in policy.stats().round_ms


def test_an_exploration_cut_short_measures_the_cheapest_round_before_it_ends():
    """The demo's DFlash Engine: a turn at B = 4 ended amid the exploration there (its drafting
    Ks measured, not 0), its last rows ran at smaller B, and the next turn's B = 4 took a round
    of 0 scaled from one of them, ~60% too slow, which made K = 3 look like a gain. Here the
    smaller B is 2. The exploration ends only once the cheapest round is measured at its B:
    rounds of 0 first, then no drafting."""
    def cost(k, b):  # a round of 0 grows little with its rows, a verify's drafts grow more
        return 1.0 + 0.1 * (b - 1) + (k > 0) * 0.2 * (1 + k) * b

    policy = DraftPolicy(KS, "mtp")
    nd = STINT + MIN_SAMPLES
    _, first = _simulate(policy, cost, 0.8, 3 * nd, b=4)
    assert first == [3] * nd + [2] * nd + [1] * nd  # the turn ends before 0 is measured
    _simulate(policy, cost, 0.8, 200, b=2)
    assert policy._time(0, 4) > 1.3 * cost(0, 4)  # scaled from B = 2: too slow
    _, again = _simulate(policy, cost, 0.8, 200, b=4)
    n = 1 + WARM_ROUNDS + MIN_SAMPLES + SETTLE - 1
    assert again[:n] == [0] * n
    assert policy._time(0, 4) == pytest.approx(cost(0, 4))
    assert again[n:].count(0) > 0.95 * len(again[n:])  # drafting loses at B = 4


@pytest.mark.parametrize("window", [0, 64])
def test_probes_keep_their_budget_of_the_requests_that_draft_beside_ones_that_do_not(window):
    """Requests with speculative="off" take turns with ones that draft (the spec_policy
    benchmark's "policy:off" and "policy" turns in one Engine): the probes' loss is paid by
    the requests that draft, so it stays within their budget of those requests' time (counting
    every round between probes, 2.4x its budget here, 1.7x with bare rounds; 0.84 and 0.87
    counting the rounds of rows that may draft)."""
    policy = DraftPolicy(KS, "mtp", window=window)
    cost, rng = _cost(1.0, 1.0), np.random.default_rng(0)
    now = lost = drafting_s = 0.0
    last = 0
    for turn in range(200):
        on = turn % 2 == 0
        row = RowAcceptance(max(KS)) if on else None
        for left in range(128, 0, -1):
            outlook = [RowOutlook(row, left)]
            k = policy.choose(outlook, lambda k, b: True)
            bare = not k and policy.bare(outlook)
            policy.dispatched(k, outlook, bare)
            seconds = cost(k, 1) * (0.97 if bare else 1.0) + 2.0 * (k != last)
            produced = 1
            while produced <= min(k, left - 1) and rng.random() < 0.2:
                produced += 1
            if row is not None:
                policy.add_row(row, k, k + 1, produced, produced)
            now += seconds
            policy.round_done(k, 1, now, produced, bare)
            last = k
            if on and turn >= 20:  # past the exploration
                drafting_s += seconds
                lost += seconds - produced * cost(0, 1) * (0.97 if bare else 1.0)
        policy.interrupt()  # the next request's prefill
    assert 0 < lost <= 1.25 * PROBE_BUDGET_FAR * drafting_s, lost / drafting_s / PROBE_BUDGET_FAR
