"""MTP speculative decoding in the Program: greedy output equals decoding without it at every B,
in any arrival order, from root and from checkpoints; rounds propose several tokens; a commit of
any accepted prefix continues exactly; nothing compiles after start-up."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from ninfer_jax.errors import ConfigError
from ninfer_jax.loader import load_model
from ninfer_jax.models.qwen3_6.weights import init_params
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.program import Program
from ninfer_jax.sampling_params import SamplingParams
from ninfer_jax.testing.configs import tiny_dense
from tests.models.conftest import loaded
from tests.program.test_program import COUNTER, check_idle_runs_change_nothing

GREEDY = SamplingParams(temperature=0.0)
PCFG = dict(max_concurrency=8, page_size=4, num_pages=200, max_seq_len=72, prefill_chunk=8,
            num_checkpoint_slots=4)
BUDGET = 24


@functools.cache
def _model(name: str):
    """The embedded demo model (a trained MTP head), or the `dense_vl` fixture: an HF
    checkpoint with random `mtp.*` weights (drafts mostly rejected: the correction path)."""
    m = load_model() if name == "demo" else loaded(name)
    return m.config, m.params


@functools.cache
def spec_program(name: str, k: int, max_concurrency: int = 4, policy: str = "fixed") -> Program:
    """Every exact B of 1..max_concurrency is compiled, which dominates these tests' time: the
    default tier runs B = 1..4 at K = 2, the slow tier B = 1..8 at K = 1, 2, 3."""
    cfg, params = _model(name)
    pcfg = ProgramConfig(**{**PCFG, "max_concurrency": max_concurrency,
                            "num_checkpoint_slots": 4 if name == "demo" else 0,
                            "speculative": "mtp" if k else "off", "num_speculative_tokens": k,
                            "draft_policy": policy})
    prog = Program(cfg, params, pcfg)
    prog.wait_compiled()
    return prog


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(rng.integers(3, 21))).tolist() for _ in range(n)]


def generate(prog: Program, prompts, budget: int = BUDGET, order=None, accept=None,
             sources=None, drafts=None):
    """Greedy continuations of `prompts`, decoded together; one row joins per round in `order`
    while fewer than max_concurrency decode.
    `accept(produced)` picks how many of a row's round tokens to commit (default: all);
    `drafts(round)` the round's draft count (default: the most);
    `sources[i]` a checkpoint to start row i from. Returns (outputs, produced per row-round)."""
    order = list(range(len(prompts))) if order is None else list(order)
    live: dict[int, object] = {}
    outputs: dict[int, list[int]] = {}
    produced_log: list[int] = []
    while order or live:
        if order and len(live) < prog.pcfg.max_concurrency:
            i = order.pop(0)
            source = (sources or {}).get(i)
            plan = prog.plan_admission(len(prompts[i]), budget, source)
            h = prog.materialize(plan, prompts[i], GREEDY)
            while (b := prog.prefill(h)) is None:
                pass
            prog.commit(b, [1])
            live[i] = h
        rows = [i for i, h in live.items() if prog.num_generated(h) < budget]
        if rows:
            k = None if drafts is None else drafts(len(produced_log))
            b = prog.decode([live[i] for i in rows], drafts=k)
            produced = b.produced.tolist()
            assert all(1 <= n <= prog.pcfg.verify_width if k is None else k + 1
                       for n in produced)
            produced_log.extend(produced)
            prog.commit(b, [accept(n) if accept else n for n in produced])
        for i in [i for i, h in live.items() if prog.num_generated(h) >= budget]:
            h = live.pop(i)
            outputs[i] = prog.tokens(h)[len(prompts[i]):]
            prog.release(h)
    return [outputs[i] for i in range(len(prompts))], produced_log


@functools.cache
def baseline(name: str, n: int, max_concurrency: int = 4) -> list[list[int]]:
    prog = spec_program(name, 0, max_concurrency)
    return generate(prog, _prompts(n, prog.cfg.vocab_size), order=_order(n, max_concurrency))[0]


def _order(n: int, batch: int) -> list[int]:
    """An arrival order of n rows (a permutation seeded by the batch size)."""
    return list(np.random.default_rng(batch).permutation(n))


def _check_greedy_equal(name: str, k: int, max_concurrency: int, n: int) -> list[int]:
    prog = spec_program(name, k, max_concurrency)
    prompts = _prompts(n, prog.cfg.vocab_size)
    want = baseline(name, n, max_concurrency)
    got, produced = generate(prog, prompts, order=_order(n, max_concurrency))
    assert got == want
    got, _ = generate(prog, prompts, order=list(reversed(_order(n, max_concurrency))))
    assert got == want
    assert prog.stats().num_sequences == 0
    assert prog.stats().free_slots == max_concurrency
    assert prog.stats().free_pages == prog.stats().total_pages
    assert max(produced) <= k + 1
    return produced


def test_greedy_equals_no_speculation_at_every_batch_and_arrival_order():
    produced = _check_greedy_equal("demo", 2, 4, 4)
    assert np.mean(produced) > 1.3  # the trained head's drafts are often right


def test_idle_runs_on_the_sink_keep_the_heads_kv():
    """Every round run on the sink (`Program.run_idle`, what an idle Engine does to warm
    them) between two sequences' rounds: their state, the MTP head's K/V and output stay."""
    prog = spec_program("demo", 2, 2, "adaptive")
    check_idle_runs_change_nothing(prog, _prompts(2, prog.cfg.vocab_size, seed=6), 16)


def test_rounds_of_any_draft_count_keep_greedy_output_and_the_heads_kv():
    """An adaptive Program decodes each round with any compiled K (0 = the plain step): the
    same greedy tokens as no speculation, and a round of 0 drafts leaves the MTP head's K/V at
    every committed position as verify rounds do (what later drafts read): after a prefill or
    forced control it writes the position before its own too, after a decode round (lean,
    whatever that round committed) only its own."""
    prog = spec_program("demo", 2, 2, "adaptive")
    assert prog.pcfg.round_drafts == (0, 1, 2)
    prompts = _prompts(3, prog.cfg.vocab_size, seed=3)
    want = generate(spec_program("demo", 0, 2), prompts)[0]
    ks = np.random.default_rng(0).integers(0, 3, size=400).tolist()
    lean = prog.lean_rounds
    got, produced = generate(prog, prompts, drafts=lambda r: ks[r % 400])
    assert got == want
    assert max(produced) == 3 and min(produced) == 1
    assert prog.lean_rounds > lean

    def head_kv(k: int) -> np.ndarray:  # the head's K at every committed position of a row
        plan = prog.plan_admission(len(prompts[0]), BUDGET, None)
        h = prog.materialize(plan, prompts[0], GREEDY)
        while (b := prog.prefill(h)) is None:
            pass
        prog.commit(b, [1])
        rounds, controlled = 0, False
        while prog.num_generated(h) < 16:
            if prog.num_generated(h) == 6 and not controlled:  # forced control, its token
                b, controlled = prog.control(h, [5, 9]), True
                prog.commit(b, [1])
                continue
            # before the control, every other round commits one token less than it proposes
            b = prog.decode([h], drafts=(k, 0, 1)[rounds % 3] if k else 0)
            rounds += 1
            short = int(not controlled and rounds % 2 == 1)
            end = 16 if controlled else 6
            prog.commit(b, [max(1, min(n - short, end - prog.num_generated(h)))
                            for n in b.produced.tolist()])
        seq, per_layer = prog._seq(h), prog.pcfg.num_pages + 1
        first = prog.cfg.num_attention_layers  # the head's layers follow the model's
        k_pool = np.asarray(prog.pools.kv[0])
        rows = [k_pool[(first + layer) * per_layer + p] for layer in
                range(k_pool.shape[0] // per_layer - first) for p in seq.pages]
        kv = np.concatenate(rows).reshape(-1, len(seq.pages) * prog.pcfg.page_size,
                                          *k_pool.shape[2:])[:, : seq.frontier - 1]
        prog.release(h)
        return kv

    lean = prog.lean_rounds
    only_zeros = head_kv(0)
    assert prog.lean_rounds > lean
    np.testing.assert_allclose(only_zeros, head_kv(2), atol=2e-4)


def test_bare_rounds_leave_the_heads_entries_empty_and_the_output_unchanged():
    """Rounds of 0 that skip the MTP head's upkeep (`decode(bare=True)`) between rounds of
    any K: the same greedy tokens as no speculation; the head's K/V at a bare round's position
    are zeros (an entry its attention skips) unless a verify round right after it rewrites
    that position (frontier - 1), and equal the upkeep's everywhere else; a bare round is
    taken only after a decode round (after a prefill or a verify the round keeps the upkeep,
    which writes frontier - 1); `context_stale` counts the upkeep rounds still to go."""
    prog = spec_program("demo", 2, 2, "adaptive")
    window = prog.limits.context_window
    assert window > 0
    prompt = _prompts(1, prog.cfg.vocab_size, seed=5)[0]
    want = generate(spec_program("demo", 0, 2), [prompt], budget=40)[0][0]
    plan = ["bare", 2, "bare", "bare", 0, "bare", 1, "bare", "bare", "bare", 2, 0] * 4

    def run(rounds: list) -> tuple:
        h = prog.materialize(prog.plan_admission(len(prompt), 40, None), prompt, GREEDY)
        while (b := prog.prefill(h)) is None:
            pass
        prog.commit(b, [1])
        holes, after_decode, stale = set(), False, []
        for k in rounds:
            if prog.num_generated(h) >= 40:
                break
            bare = k == "bare"
            before, frontier = prog.bare_rounds, prog._seq(h).frontier
            b = prog.decode([h], drafts=0 if bare else k, bare=bare)
            assert prog.bare_rounds - before == int(bare and after_decode)
            if bare and after_decode:
                holes.add(frontier)
            elif k:  # a verify round rewrites frontier - 1
                holes.discard(frontier - 1)
            prog.commit(b, [min(n, 40 - prog.num_generated(h)) for n in b.produced.tolist()])
            after_decode = True
            stale.append(prog.context_stale(h))
        seq, per_layer = prog._seq(h), prog.pcfg.num_pages + 1
        first = prog.cfg.num_attention_layers
        k_pool = np.asarray(prog.pools.kv[0])
        head = np.concatenate([k_pool[first * per_layer + p] for p in seq.pages])
        tokens, pages = prog.tokens(h)[len(prompt):], list(seq.pages)
        prog.release(h)
        return tokens, holes, head[: seq.frontier - 1], stale, pages

    # the upkeep's run first: its pages, written, are the bare run's (zeros are written)
    whole_tokens, _, whole, _, pages = run([0 if k == "bare" else k for k in plan])
    assert whole_tokens == want
    got, holes, head, stale, reused = run(plan)
    assert got == want and holes and set(reused) == set(pages)
    empty = np.zeros(len(head), bool)
    empty[sorted(holes)] = True
    assert not head[empty].any()
    assert np.abs(head[~empty]).min(axis=(1, 2)).max() > 0  # written entries are not zeros
    np.testing.assert_allclose(head[~empty], whole[~empty], atol=2e-4)
    assert max(stale) == window  # right after a bare round; one less per round of upkeep


@pytest.mark.slow  # ~50 s; the Engine's MTP greedy test (reuse on and off) stays by default
def test_greedy_equals_no_speculation_on_a_fixture_with_mtp_weights():
    """Random weights: drafts are mostly wrong, so the correction path carries the output."""
    produced = _check_greedy_equal("dense_vl", 2, 2, 2)
    assert min(produced) == 1


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_no_speculation_at_b_1_to_8(k):
    produced = _check_greedy_equal("demo", k, 8, 8)
    assert max(produced) == k + 1


def test_committing_a_shorter_prefix_continues_exactly():
    """A terminal row may accept fewer tokens than produced: the state after exactly that
    many positions is adopted (GDN state, K/V frontier, MTP context), so later rounds match."""
    prog = spec_program("demo", 2)
    got, produced = generate(prog, _prompts(4, prog.cfg.vocab_size), order=_order(4, 4),
                             accept=lambda n: 1)
    assert got == baseline("demo", 4)
    assert max(produced) > 1  # drafts were right, and one token was kept anyway


def test_prefix_reuse_with_speculation_continues_as_recompute():
    prog = spec_program("demo", 2)
    prompts = _prompts(4, prog.cfg.vocab_size)
    # A checkpoint at the end of prompt 0 after its continuation; prompts extending it.
    first, _ = generate(prog, prompts[:1], budget=10)
    cont = prompts[0] + first[0]
    h = prog.materialize(prog.plan_admission(len(cont) - 1, 1), cont[:-1], GREEDY)
    while (b := prog.prefill(h)) is None:
        pass
    prog.commit(b, [1])
    ctx = np.asarray(prog.pools.ctx[prog._seq(h).slot])  # the hidden state at frontier - 1
    assert np.abs(ctx).max() > 0
    ckpt = prog.capture(h)
    prog.release(h)
    r = prog.materialize(prog.plan_admission(len(cont) + 1, 1, ckpt), cont + [5], GREEDY)
    np.testing.assert_array_equal(prog.pools.ctx[prog._seq(r).slot], ctx)  # restored with it
    prog.release(r)
    longer = [cont + p[:5] for p in prompts[1:4]] + [cont[:-1] + [cont[-1]]]
    fresh, fresh_log = generate(prog, longer)
    reused, reused_log = generate(prog, longer, sources={i: ckpt for i in range(len(longer))})
    prog.release_checkpoint(ckpt)
    assert reused == fresh
    assert reused_log == fresh_log  # the head's K/V restored exactly: the same drafts accepted
    assert prog.stats().free_pages == prog.stats().total_pages


def test_no_trace_or_compile_after_start_up_at_every_batch():
    prog = spec_program("demo", 2)
    COUNTER.active = True
    try:
        generate(prog, _prompts(6, prog.cfg.vocab_size, seed=5))  # B = 1..4 and back
    finally:
        COUNTER.active = False
    assert COUNTER.count == 0, f"{COUNTER.count} traces or compiles after start-up"


def test_a_model_without_mtp_weights_refuses_mtp():
    cfg = tiny_dense()
    import jax

    params = init_params(cfg, jax.random.key(0))
    with pytest.raises(ConfigError, match="speculative='mtp' needs a model with MTP weights"):
        Program(cfg, params, ProgramConfig(**{**PCFG, "speculative": "mtp",
                                              "num_speculative_tokens": 2}))


@pytest.mark.slow  # ~45 s; the Program's sampled-commit test (test_speculative.py) stays
def test_sampled_rows_follow_non_speculative_sampling():
    """Thousands of seeded requests, each a prefill (token a, drawn as without speculation)
    and one verify round (token b first): the pair (a, b) follows the model's own
    distribution p(a) p(b | a) under the row's transform (temperature 1, top-k 6, top-p 0.9),
    by a chi-square test at fixed seeds. The demo's trained head drafts close to, but not
    exactly, the target's distribution, so b comes through acceptance as well as rejection and
    the residual draw; a wrong draft distribution or acceptance ratio shifts the pairs."""
    prog = spec_program("demo", 2)
    cfg, _ = _model("demo")
    prompt = _prompts(1, cfg.vocab_size, seed=11)[0]
    n = 2000
    counts: dict[tuple[int, int], int] = {}
    for first in range(0, n, 4):
        handles = []
        for seed in range(first, first + 4):
            sp = SamplingParams(temperature=1.0, top_k=6, top_p=0.9, seed=seed)
            h = prog.materialize(prog.plan_admission(len(prompt), 2), prompt, sp)
            while (b := prog.prefill(h)) is None:
                pass
            prog.commit(b, [1])
            handles.append(h)
        b = prog.decode(handles)
        prog.commit(b, [1] * 4)
        for h in handles:
            a, second = prog.tokens(h)[len(prompt):]
            counts[a, second] = counts.get((a, second), 0) + 1
            prog.release(h)

    assert_pairs_follow_the_model(counts, prompt, n)


def assert_pairs_follow_the_model(counts: dict, prompt: list[int], n: int) -> None:
    """`counts` of n sampled (a, b) pairs after `prompt` follow the demo model's own
    p(a) p(b | a) under temperature 1, top-k 6, top-p 0.9: cells expected below 5 pooled into
    one, chi-square against the p = 1e-3 critical value."""
    import jax
    import jax.numpy as jnp

    from ninfer_jax.models.qwen3_6 import forward
    from ninfer_jax.program.sampling import sampling_arrays
    from ninfer_jax.program.speculative import transformed_probs

    cfg, params = _model("demo")
    sp = SamplingParams(temperature=1.0, top_k=6, top_p=0.9, seed=0)
    arrays = jax.tree.map(jnp.asarray, sampling_arrays([sp]))
    v = cfg.vocab_size
    zeros, no_prompt = jnp.zeros((1, v), jnp.int32), jnp.zeros((1, v), bool)

    def probs(ids: list[int]) -> np.ndarray:
        logits = forward(params, cfg, jnp.asarray([ids], jnp.int32))[:, -1]
        return np.asarray(transformed_probs(logits, arrays, zeros, no_prompt))[0]

    p_a = probs(prompt)
    expected = {}
    for a in np.flatnonzero(p_a):
        p_b = probs(prompt + [int(a)])
        for b_tok in np.flatnonzero(p_b):
            expected[int(a), int(b_tok)] = n * p_a[a] * p_b[b_tok]
    assert set(counts) <= set(expected), "a pair the transformed distribution excludes"
    small = sum(e for e in expected.values() if e < 5)
    small_obs = sum(counts.get(c, 0) for c, e in expected.items() if e < 5)
    cells = [(counts.get(c, 0), e) for c, e in expected.items() if e >= 5]
    if small > 0:
        cells.append((small_obs, small))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    critical = CHI2_CRIT_1E3[dof - 1]
    assert stat < critical, f"chi-square {stat:.1f} >= {critical} with {dof} dof: {cells}"


# scipy.stats.chi2.isf(1e-3, dof) for dof = 1..40 (scipy 1.17), so the test needs no scipy.
CHI2_CRIT_1E3 = (10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26,
                 32.91, 34.53, 36.12, 37.70, 39.25, 40.79, 42.31, 43.82, 45.31, 46.80, 48.27,
                 49.73, 51.18, 52.62, 54.05, 55.48, 56.89, 58.30, 59.70, 61.10, 62.49, 63.87,
                 65.25, 66.62, 67.99, 69.35, 70.70, 72.05, 73.40)
