"""DFlash speculative decoding in the Program: greedy output equals decoding without it at every
B, in any arrival order, from root and from checkpoints (the drafter's context window restored
from them and from their host images); the context ring holds exactly the target's context;
sampled rows follow non-speculative sampling; nothing compiles after start-up.

Two drafters: the demo model's trained drafter (`ninfer_jax/assets/demo_dflash`, window 64:
drafts often accepted) and a random one with a window of 16 (`testing.tiny_drafter`: drafts
mostly rejected, and short sequences wrap its ring many times)."""

from __future__ import annotations

import dataclasses
import functools
import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.errors import CheckpointError, ConfigError
from ninfer_jax.loader import DEFAULT_DRAFTER, load_drafter, load_model
from ninfer_jax.models.dflash.model import context_kv
from ninfer_jax.models.dflash.weights import init_params as drafter_init
from ninfer_jax.models.qwen3_6 import CausalKV, GDNState, step
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.pools import context_positions, context_ring
from ninfer_jax.program.program import Program
from ninfer_jax.sampling_params import SamplingParams
from ninfer_jax.testing.configs import tiny_drafter
from tests.program.test_program import COUNTER, check_idle_runs_change_nothing
from tests.program.test_speculative_program import (
    GREEDY,
    PCFG,
    _order,
    _prompts,
    assert_pairs_follow_the_model,
    generate,
    spec_program,
)

BUDGET = 48  # prompts of 3..20 tokens: sequences of up to 68 (max_seq_len 72)


@functools.cache
def _drafter(name: str):
    m = load_model()
    if name == "trained":
        d = load_drafter(DEFAULT_DRAFTER)
        return d.config, d.params
    cfg = tiny_drafter(m.config)
    return cfg, drafter_init(cfg, jax.random.key(3), std=0.05)


@functools.cache
def dflash_program(name: str, k: int, max_concurrency: int = 4,
                   head: str | None = None, policy: str = "fixed") -> Program:
    """The MTP tests' settings; the baseline is their Program without speculation. The
    trained drafter drafts with the default head (the full proposal) unless `head` says; the
    random one with its candidate selector. `policy`: ProgramConfig.draft_policy ("fixed":
    only rounds of k drafts compile)."""
    m = load_model()
    head = head or ("full" if name == "trained" else "selector")
    pcfg = ProgramConfig(**{**PCFG, "max_concurrency": max_concurrency, "draft_head": head,
                            "speculative": "dflash", "num_speculative_tokens": k,
                            "draft_policy": policy})
    dcfg, dparams = _drafter(name)
    prog = Program(m.config, {**m.params, "dflash": dparams}, pcfg, drafter=dcfg)
    prog.wait_compiled()
    return prog


@functools.cache
def baseline(n: int, budget: int = BUDGET) -> list[list[int]]:
    """Without speculation, on the MTP tests' Program (max_concurrency 4): greedy output does
    not depend on the batch a row decodes in, so one baseline serves every max_concurrency."""
    prog = spec_program("demo", 0)
    return generate(prog, _prompts(n, prog.cfg.vocab_size), budget=budget)[0]


def _check_greedy_equal(name: str, k: int, max_concurrency: int, n: int,
                        budget: int = BUDGET, head: str | None = None) -> list[int]:
    prog = dflash_program(name, k, max_concurrency, head)
    prompts = _prompts(n, prog.cfg.vocab_size)
    want = baseline(n, budget)
    for order in (_order(n, max_concurrency), list(reversed(_order(n, max_concurrency)))):
        got, produced = generate(prog, prompts, budget=budget, order=order)
        assert got == want
    s = prog.stats()
    assert (s.num_sequences, s.free_slots, s.free_pages) == (0, max_concurrency, s.total_pages)
    assert max(produced) <= k + 1
    return produced


@pytest.mark.slow  # 90 s cold; the default tier keeps the ring and random-drafter checks
def test_greedy_equals_no_speculation_at_every_batch_and_arrival_order():
    produced = _check_greedy_equal("trained", 4, 4, 6)
    assert np.mean(produced) > 1.5  # the trained drafter's blocks are often right
    assert max(produced) == 5


@pytest.mark.slow  # ~70 s; the trained drafter's greedy test stays in the default run
def test_greedy_equals_no_speculation_with_a_random_drafter_and_a_wrapping_ring():
    """Window 16, sequences up to 68 tokens: every ring entry is rewritten several times,
    and nearly every draft is rejected (the correction path carries the output)."""
    produced = _check_greedy_equal("random", 3, 2, 3)
    assert np.mean(produced) < 1.2


@pytest.mark.slow
@pytest.mark.parametrize("k", [4, 8, 15])
@pytest.mark.parametrize("head", ["full", "selector"])
def test_greedy_equals_no_speculation_at_b_1_to_8(k, head):
    try:
        produced = _check_greedy_equal("trained", k, 8, 8, head=head)
        assert max(produced) > 4
    finally:  # six Programs at max_concurrency 8 would pass the process's memory mappings
        dflash_program.cache_clear()
        gc.collect()


def _expected_context(prog: Program, tokens: list[int], frontier: int):
    """The drafter's context K/V of positions 0..frontier-1 from one full forward."""
    cfg, params = prog.cfg, prog.params
    ids = jnp.asarray([tokens[:frontier]], jnp.int32)
    out = step(params, cfg, ids, jnp.zeros((1,), jnp.int32), GDNState.zeros(cfg, 1),
               CausalKV(), feature_layers=prog.drafter.target_layer_ids)
    return context_kv(params["dflash"], prog.drafter, out.features,
                      jnp.arange(frontier, dtype=jnp.int32)[None])


def _check_ring(prog: Program, name: str, drafts) -> list[int]:
    """Decodes one row, round r with drafts[r] drafts ("bare": a round of 0 that skips the
    drafter's upkeep), and checks its ring against a full forward (bare rounds' positions
    aside: they keep an older position's entry, which no block reads), what `context_stale`
    says, and a checkpoint's image of it (the held entries from `context_from` on, zeros
    elsewhere); returns its tokens."""
    prompt = _prompts(1, prog.cfg.vocab_size, seed=7)[0]
    h = prog.materialize(prog.plan_admission(len(prompt), 48), prompt, GREEDY)
    while (b := prog.prefill(h)) is None:
        pass
    prog.commit(b, [1])
    bare = []
    for k in drafts:
        if prog.num_generated(h) == 48:
            break
        if k == "bare":
            if prog.limits.context_window:  # else the round runs the upkeep
                bare.append(prog._seq(h).frontier)
            b = prog.decode([h], drafts=0, bare=True)
        else:
            b = prog.decode([h], drafts=k)
        prog.commit(b, b.produced.tolist())
    seq = prog._seq(h)
    frontier, tokens = seq.frontier, prog.tokens(h)
    ring, kept = context_ring(prog.drafter, prog.pcfg)
    assert frontier > (ring if name == "random" else 30)  # the random drafter's ring wrapped
    pos, held = (np.asarray(a)[0] for a in context_positions(jnp.array([frontier]), ring,
                                                               kept))
    want_k, want_v = (np.asarray(a)[0] for a in _expected_context(prog, tokens, frontier))
    got_k, got_v = (np.asarray(a)[seq.slot] for a in (prog.pools.dk, prog.pools.dv))
    assert held.sum() == min(frontier, kept)
    for i in np.flatnonzero(held):
        if pos[i] not in bare:
            np.testing.assert_allclose(got_k[i], want_k[pos[i]], atol=2e-5)
            np.testing.assert_allclose(got_v[i], want_v[pos[i]], atol=2e-5)
    assert seq.context_from == (bare[-1] + 1 if bare else 0)
    stale = max(bare[-1] + 1 + kept - frontier, 0) if bare else 0
    assert prog.context_stale(h) == stale
    ckpt = prog.capture(h)
    image = np.asarray(prog.pools.ck_dk)[prog.checkpoints.record(ckpt).slot]
    readable = held & (pos >= seq.context_from)
    assert not np.any(image[~readable])
    for i in np.flatnonzero(readable):
        np.testing.assert_allclose(image[i], want_k[pos[i]], atol=2e-5)
    prog.release_checkpoint(ckpt)
    prog.release(h)
    return tokens


@pytest.mark.slow  # ~50-70 s each; the Engine's DFlash greedy test (reuse on, off) stays
@pytest.mark.parametrize("name,k", [("random", 3), ("trained", 4)])
def test_the_ring_holds_the_targets_context_for_every_held_position(name, k):
    """After prefill chunks and speculative rounds (rejected positions written too), every
    entry the ring holds at the frontier equals the context K/V a full forward gives, and the
    ring holds every position the next block can see."""
    _check_ring(dflash_program(name, k, 4 if name == "trained" else 2), name, [None] * 10)


def test_rounds_of_any_draft_count_keep_greedy_output_and_the_ring():
    """An adaptive Program (rounds of 0, 1, 4 and 7 drafts) switching K every round: the
    greedy tokens of no speculation, and a ring that holds the target's context (a round of
    0 drafts writes its position as a verify round does)."""
    prog = dflash_program("trained", 7, 1, policy="adaptive")
    assert prog.pcfg.round_drafts == (0, 1, 4, 7)
    ks = [0, 7, 0, 0, 4, 1, 0, 7, 4, 0, 0, 0, 7, 7, 1, 0, 4, 1]
    prompt = _prompts(1, prog.cfg.vocab_size, seed=7)[0]
    generated = _check_ring(prog, "trained", ks)[len(prompt):]
    assert len(generated) > 20
    assert generated == generate(spec_program("demo", 0), [prompt], budget=len(generated))[0][0]


def test_bare_rounds_leave_their_positions_out_of_the_ring_and_the_output_unchanged():
    """Rounds of 0 that skip the drafter's upkeep (`decode(bare=True)`) between rounds of
    every K: the greedy tokens of no speculation; the ring holds the target's context at every
    other held position; W rounds of upkeep after the last one, the ring is the one the upkeep
    would have left (W: the drafter's window). On the Program of the next test (one row)."""
    prog = dflash_program("random", 7, 2, policy="adaptive")
    assert prog.limits.context_window == 16
    prompt = _prompts(1, prog.cfg.vocab_size, seed=7)[0]
    want = generate(spec_program("demo", 0), [prompt], budget=48)[0][0]
    gaps = _check_ring(prog, "random", [7, 0, "bare", 4, "bare", "bare", 1] * 6 + ["bare"] * 8)
    whole = _check_ring(prog, "random", [7, "bare", "bare", 4] * 5 + [0] * 40)
    assert gaps[len(prompt):] == whole[len(prompt):] == want


def test_a_block_after_bare_rounds_reads_the_ring_only_past_them():
    """A bare round writes no ring entry (its position's keeps an older one's), so a round
    that drafts reads the ring only from the row's `context_from` on: of two rows of the same
    tokens whose contexts had rounds of upkeep after bare ones, one ring's entries below it
    overwritten with noise, both draft the same (their rings get the same entries at the
    drafts' positions); noise at or past it changes the drafts (the check can fail)."""
    prog = dflash_program("random", 7, 2, policy="adaptive")
    prompt = _prompts(1, prog.cfg.vocab_size, seed=11)[0]
    ring, kept = context_ring(prog.drafter, prog.pcfg)

    def drafted(noise_below: bool) -> list[np.ndarray]:
        hs = [prog.materialize(prog.plan_admission(len(prompt), 30), prompt, GREEDY)
              for _ in range(2)]
        for h in hs:
            while (b := prog.prefill(h)) is None:
                pass
            prog.commit(b, [1])
        for k in [0] * 6 + ["bare"] * 4 + [0] * 5:
            b = prog.decode(hs, drafts=0, bare=k == "bare")
            prog.commit(b, [1, 1])
        seqs = [prog._seq(h) for h in hs]
        frontier, start = seqs[0].frontier, seqs[0].context_from
        assert start == frontier - 5 and prog.context_stale(hs[0]) > 0
        pos, held = (np.asarray(a)[0] for a in context_positions(jnp.array([frontier]), ring,
                                                                   kept))
        noisy = np.flatnonzero(held & ((pos < start) if noise_below else (pos >= start)))
        assert len(noisy) >= 5
        pools = prog.pools
        noise = jax.random.normal(jax.random.key(0), (len(noisy), *pools.dk.shape[2:]),
                                  pools.dk.dtype)
        prog._pools = dataclasses.replace(
            pools, dk=pools.dk.at[seqs[1].slot, noisy].set(noise),
            dv=pools.dv.at[seqs[1].slot, noisy].set(noise))
        b = prog.decode(hs, drafts=7)
        prog.commit(b, b.produced.tolist())
        after = [frontier + 1 + j for j in range(7)]  # written from the drafts' features
        dk = np.asarray(prog.pools.dk)
        rows = [dk[s.slot][[p % ring for p in after]] for s in seqs]
        for h in hs:
            prog.release(h)
        return rows

    same = drafted(noise_below=True)
    np.testing.assert_array_equal(same[0], same[1])
    other = drafted(noise_below=False)
    assert not np.array_equal(other[0], other[1])


def test_bare_rounds_are_compiled_only_where_a_window_bounds_the_context():
    """The trained drafter's window of 64 plus a round spans these sequences' whole length,
    a fixed K never runs rounds of 0: no bare rounds there (`decode(bare=True)` runs the
    upkeep, its entry is written)."""
    assert dflash_program("trained", 7, 1, policy="adaptive").limits.context_window == 0
    assert dflash_program("random", 3, 2).limits.context_window == 0
    _check_ring(dflash_program("trained", 7, 1, policy="adaptive"), "trained",
                [0, "bare", 7] * 12)


def test_idle_runs_on_the_sink_keep_the_drafters_ring():
    """Every round run on the sink slot (`Program.run_idle`, what an idle Engine does to warm
    them) between a sequence's rounds: its ring, state and output stay as they were."""
    prog = dflash_program("trained", 7, 1, policy="adaptive")
    check_idle_runs_change_nothing(prog, _prompts(1, prog.cfg.vocab_size, seed=5), 24)


@pytest.mark.slow  # ~60 s; the Engine's DFlash test with reuse on stays in the default run
def test_prefix_reuse_restores_the_drafters_context():
    """A checkpoint carries the ring: sequences started from it draft exactly what a fresh
    prefill of the same tokens drafts (the same produced counts), and its host image round trip
    changes no byte and continues the same way."""
    prog = dflash_program("trained", 4)
    prompts = _prompts(4, prog.cfg.vocab_size, seed=3)
    first, _ = generate(prog, prompts[:1], budget=24)
    cont = prompts[0] + first[0]
    h = prog.materialize(prog.plan_admission(len(cont) - 1, 1), cont[:-1], GREEDY)
    while (b := prog.prefill(h)) is None:
        pass
    prog.commit(b, [1])
    ckpt = prog.capture(h)
    prog.release(h)
    longer = [cont + p[:5] for p in prompts[1:4]] + [cont]
    fresh, fresh_log = generate(prog, longer, budget=20)
    reused, reused_log = generate(prog, longer, budget=20,
                                  sources={i: ckpt for i in range(len(longer))})
    assert reused == fresh and reused_log == fresh_log
    image = prog.export_checkpoint(ckpt)
    prog.release_checkpoint(ckpt)
    imported = prog.import_checkpoint(image)
    again = prog.export_checkpoint(imported)
    assert again.state.tobytes() == image.state.tobytes()
    via_image, image_log = generate(prog, longer, budget=20,
                                    sources={i: imported for i in range(len(longer))})
    prog.release_checkpoint(imported)
    assert via_image == fresh and image_log == fresh_log
    s = prog.stats()
    assert s.free_pages == s.total_pages and s.num_checkpoints == 0


@pytest.mark.slow  # ~50 s; the Engine's DFlash test with reuse on and off stays by default
def test_a_checkpoint_holds_only_what_its_tokens_determine():
    """A slot whose ring is full of an earlier sequence's entries and rejected drafts: a
    checkpoint captured from it holds the context of its own positions and zeros elsewhere,
    so its StateImage bytes depend on its tokens alone (what content-addressed blocks need)."""
    prog = dflash_program("random", 3, 2)
    prompt = _prompts(1, prog.cfg.vocab_size, seed=9)[0]
    generate(prog, [prompt, prompt[::-1]], budget=48)  # both slots: wrapped rings
    tokens = prompt + [7, 8, 9] * 5
    h = prog.materialize(prog.plan_admission(len(tokens), 4), tokens, GREEDY)
    while (b := prog.prefill(h)) is None:
        pass
    prog.commit(b, [1])
    for _ in range(3):  # rounds write the ring past the frontier; commit one token each
        prog.commit(prog.decode([h]), [1])
    frontier, all_tokens = prog._seq(h).frontier, prog.tokens(h)
    ckpt = prog.capture(h)
    prog.release(h)
    ring, kept = context_ring(prog.drafter, prog.pcfg)
    pos, held = (np.asarray(a)[0] for a in context_positions(jnp.array([frontier]), ring,
                                                               kept))
    want_k, _ = (np.asarray(a)[0] for a in _expected_context(prog, all_tokens, frontier))
    got = np.asarray(prog.pools.ck_dk)[prog.checkpoints.record(ckpt).slot]
    assert not np.any(got[~held])
    for i in np.flatnonzero(held):
        np.testing.assert_allclose(got[i], want_k[pos[i]], atol=2e-5)
    prog.release_checkpoint(ckpt)


def test_no_trace_or_compile_after_start_up_at_every_batch():
    prog = dflash_program("trained", 4)
    COUNTER.active = True
    try:
        generate(prog, _prompts(6, prog.cfg.vocab_size, seed=5), budget=20)
    finally:
        COUNTER.active = False
    assert COUNTER.count == 0, f"{COUNTER.count} traces or compiles after start-up"


def test_bad_drafter_settings_are_refused_by_name():
    m = load_model()
    dcfg, dparams = _drafter("random")
    params = {**m.params, "dflash": dparams}

    def pcfg(k):
        return ProgramConfig(**{**PCFG, "speculative": "dflash", "num_speculative_tokens": k})

    with pytest.raises(ConfigError, match="needs a DFlash drafter"):
        Program(m.config, m.params, pcfg(2))
    with pytest.raises(ConfigError, match="at most the drafter's block_size - 1 = 7"):
        Program(m.config, params, pcfg(8), drafter=dataclasses.replace(dcfg, block_size=8))
    with pytest.raises(CheckpointError, match="hidden_size 96 must equal the target's"):
        Program(m.config, params, pcfg(2), drafter=dataclasses.replace(dcfg, hidden_size=96))
    with pytest.raises(ConfigError, match="num_speculative_tokens must be an integer in 1..15"):
        pcfg(16)
    with pytest.raises(ConfigError, match="a drafter is for speculative='dflash'"):
        Program(m.config, m.params, ProgramConfig(**PCFG), drafter=dcfg)
    with pytest.raises(ConfigError, match="draft_head='selector' needs a drafter with a cand"):
        Program(m.config, params, dataclasses.replace(pcfg(2), draft_head="selector"),
                drafter=dataclasses.replace(dcfg, selector_rank=0))
    with pytest.raises(ConfigError, match=r"draft_head must be one of \('full', 'selector'\) "
                                          r"\('selector' only with speculative='dflash'\)"):
        ProgramConfig(**{**PCFG, "speculative": "mtp", "num_speculative_tokens": 1,
                         "draft_head": "selector"})


@pytest.mark.slow  # ~80 s each; the [spec] chi-square test of the MTP path stays by default
@pytest.mark.parametrize("head", ["full", "selector"])
def test_sampled_rows_follow_non_speculative_sampling(head):
    """The [spec] chi-square test with the trained drafter's proposals: thousands of seeded
    requests, each a prefill (token a) and one verify round (token b first); the pair (a, b)
    follows the model's own p(a) p(b | a) under the row's transform (temperature 1, top-k 6,
    top-p 0.9). The full head's q is the proposal under that transform; the selector's is the
    softmax of its scores over 8 candidates given the token before. Either differs from p, so
    b comes through acceptance, rejection and the residual."""
    prog = dflash_program("trained", 4, head=head)
    cfg = prog.cfg
    prompt = _prompts(1, cfg.vocab_size, seed=11)[0]
    n = 2000
    counts: dict[tuple[int, int], int] = {}
    accepted = 0
    for first in range(0, n, 4):
        handles = []
        for seed in range(first, first + 4):
            sp = SamplingParams(temperature=1.0, top_k=6, top_p=0.9, seed=seed)
            # A budget of 3: the round may verify draft 1 (limit 2); it commits only b.
            h = prog.materialize(prog.plan_admission(len(prompt), 3), prompt, sp)
            while (b := prog.prefill(h)) is None:
                pass
            prog.commit(b, [1])
            handles.append(h)
        b = prog.decode(handles)
        accepted += int(np.sum(np.asarray(b.produced) > 1))
        prog.commit(b, [1] * 4)
        for h in handles:
            a, second = prog.tokens(h)[len(prompt):]
            counts[a, second] = counts.get((a, second), 0) + 1
            prog.release(h)
    assert 0.1 * n < accepted < 0.95 * n  # both acceptance and rejection happened

    assert_pairs_follow_the_model(counts, prompt, n)
