"""The draft policy replayed on the embedded model's own acceptance (`scripts/spec_policy_replay`:
the drafts each compiled K accepts from every position of the `spec_policy` benchmark's four
stories, measured once into `tests/fixtures/spec_policy/`) on three machines' round times: where
drafting loses at every K it stays with rounds of 0, and where DFlash wins it keeps most of the
best fixed K's gain. A simulated clock: no machine's noise in the verdict (nor its bursts, nor
the host's work: the benchmark decides the targets)."""

from __future__ import annotations

import pytest

from scripts import spec_policy_replay as replay

TURNS = 15


def _ratios(method: str, machine: str, b: int, seeds: int) -> tuple[float, float]:
    """The policy's mean decode tok/s over `seeds` replays, over off's and the best fixed K's."""
    r = replay.compare(method, machine, b, seeds, TURNS)
    got = sum(r["policy"]) / seeds
    return got / r["fixed"][0], got / max(r["fixed"].values())


@pytest.mark.parametrize("method", ["dflash", "mtp"])
def test_the_fixture_is_the_programs_rounds(method):
    """Every compiled K of an adaptive Program (`ProgramConfig.round_drafts`), 127 positions of
    each of four stories, accepted drafts within 0..K."""
    from ninfer_jax.program.config import ProgramConfig

    k = 15 if method == "dflash" else 3
    pcfg = ProgramConfig(max_concurrency=4, page_size=16, num_pages=64, max_seq_len=256,
                         prefill_chunk=64, num_checkpoint_slots=0, speculative=method,
                         num_speculative_tokens=k, draft_policy="adaptive")
    trace = replay.load(method)
    assert tuple(trace["ks"]) == pcfg.round_drafts[1:]
    assert len(trace["prompts"]) == 4
    for story in trace["prompts"]:
        assert len(story["out"]) == replay.NEW_TOKENS
        for kk in trace["ks"]:
            row = story["accepted"][str(kk)]
            assert len(row) == replay.NEW_TOKENS - 1 and all(0 <= a <= kk for a in row)


@pytest.mark.parametrize("method, b", [("dflash", 1), ("dflash", 4), ("mtp", 1), ("mtp", 4)])
def test_where_drafting_loses_at_every_k_the_policy_runs_rounds_of_0(method, b):
    """The fast machine (every fixed K 0.40-0.81x off): the policy within 2% of off (0.990-0.995
    when written), its probes and their upkeep all it loses."""
    over_off, _ = _ratios(method, "fast", b, seeds=3)
    assert over_off >= 0.98, over_off


@pytest.mark.parametrize("b, target", [(1, 0.85), (4, 0.95)])
def test_where_dflash_wins_the_policy_keeps_most_of_the_best_fixed_k(b, target):
    """The slow machine (fixed K = 8 1.26x off at B = 1, K = 4 1.22x at B = 4), the benchmark's
    story at B = 1: 0.90 of the best fixed K at B = 1 (the mean of 20 seeds), 0.99 at B = 4.
    At B = 1 the rest is a predictable stretch found late: once at 0 in an unpredictable one
    the policy comes back only with a probe (docs/speculative.md, "Replayed acceptance")."""
    _, over_best = _ratios("dflash", "slow", b, seeds=20)
    assert over_best >= target, over_best


def test_where_dflash_wins_narrowly_the_policy_keeps_most_of_the_best_fixed_k():
    """The machine between the two ("mid": fixed K = 8 1.08x off at B = 1, 1.21x at B = 4,
    every other K near or under off): 0.90 of K = 8 at B = 1 (the mean of 20 seeds, worst
    0.88). At B = 4 it keeps 0.85 (worst seed 0.80), under the 0.9 target: there K = 8 wins
    by ending some rows sooner, near the break-even round by round (docs/speculative.md,
    "A third machine")."""
    _, over_best = _ratios("dflash", "mid", 1, seeds=20)
    assert over_best >= 0.87, over_best
