"""Program: exact greedy tokens at every B, zero compilations after warm-up, donation, commit and
abort rules, feasibility, and no leaks after any workload."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer_jax.program.errors import (
    InfeasibleError,
    MissingExecutableError,
    PendingBatchError,
    ResourceError,
    StalePlanError,
)
from ninfer_jax.program.executable_specs import round_key
from ninfer_jax.program.executables import StepKey, StepKind
from ninfer_jax.sampling_params import SamplingParams
from tests.models.conftest import reference
from tests.program.conftest import PCFG, program, reference_greedy, run_to_completion


def _admit(prog, prompt, max_new, sampling=None):
    plan = prog.plan_admission(len(prompt), max_new)
    kwargs = {} if sampling is None else {"sampling": sampling}
    return prog.materialize(plan, prompt, **kwargs)


def _assert_all_free(prog):
    s = prog.stats()
    assert (s.free_pages, s.reserved_pages, s.free_slots, s.num_sequences) == (
        s.total_pages, 0, s.total_slots, 0), s


class CompileCounter:
    """Counts jaxpr traces and backend compiles (any new jit specialisation shows up here)."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        self.count = 0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._on)

    def _on(self, event, duration, **kwargs):
        if self.active and event in self.EVENTS:
            self.count += 1


COUNTER = CompileCounter()


def test_greedy_reproduces_transformers_tokens():
    prog, ref = program(), reference("dense")
    n, greedy = int(ref["greedy_prompt_len"]), ref["greedy_tokens"]
    handles = {_admit(prog, ref["token_ids"][r, :n].tolist(), greedy.shape[1]): greedy.shape[1]
               for r in range(3)}
    run_to_completion(prog, handles)
    for r, h in enumerate(handles):
        assert prog.tokens(h)[n:] == greedy[r].tolist()
        prog.release(h)
    _assert_all_free(prog)


def test_every_batch_size_gives_reference_greedy_with_zero_compilations():
    """B grows 1..8 as sequences arrive (mixed prompt lengths), then shrinks as budgets end."""
    prog = program()
    ids = reference("dense")["token_ids"]
    prompts = [ids[i % 3, : 3 + 5 * i].tolist() for i in range(8)]
    budgets = [10 - i + i % 3 for i in range(8)]
    prog.wait_compiled()  # start-up is over once the background compiles are done
    COUNTER.active = True
    try:
        live, handles = [], []
        batch_sizes = []
        for prompt, budget in zip(prompts, budgets):
            h = _admit(prog, prompt, budget)
            handles.append(h)
            while (pb := prog.prefill(h)) is None:
                pass
            prog.commit(pb, [1])
            live = [x for x in live + [h] if prog.num_generated(x) < budgets[handles.index(x)]]
            pb = prog.decode(live)
            batch_sizes.append(pb.batch)
            prog.commit(pb, [1] * pb.batch)
        while live := [x for x in handles if prog.num_generated(x) < budgets[handles.index(x)]]:
            pb = prog.decode(live)
            batch_sizes.append(pb.batch)
            prog.commit(pb, [1] * pb.batch)
        outputs = [prog.tokens(h)[len(p):] for h, p in zip(handles, prompts)]
        for h in handles:
            prog.release(h)
    finally:
        COUNTER.active = False
    assert set(batch_sizes) == set(range(1, 9))
    assert COUNTER.count == 0, f"{COUNTER.count} compilations after warm-up"
    for prompt, budget, out in zip(prompts, budgets, outputs):
        assert out == reference_greedy("dense", prompt, budget)
    _assert_all_free(prog)


@pytest.mark.slow  # ~36 s cold; the kernels' interpret tests and the CUDA lowering stay default
def test_pallas_kernels_give_identical_tokens():
    """The attention and GDN kernels (interpret mode) in the Program: prompts of 9 and 14
    tokens in 8-token chunks over 4-token pages (a second chunk of 1 and of 6 after 2 cached
    pages: the prefill kernels with prior state), then decode."""
    ref = reference("dense")
    prompts = [ref["token_ids"][0, :9].tolist(), ref["token_ids"][1, :14].tolist()]
    outs = {}
    for impl in ("reference", "pallas"):
        prog = program(attention_impl=impl, gdn_impl=impl, max_concurrency=2)
        handles = {_admit(prog, p, 6): 6 for p in prompts}
        run_to_completion(prog, handles)
        outs[impl] = [prog.tokens(h) for h in handles]
        for h in handles:
            prog.release(h)
        _assert_all_free(prog)
    assert outs["pallas"] == outs["reference"]


def _committed_state(prog, h):
    seq = prog._seq(h)
    pools = prog.pools
    positions = np.arange(seq.frontier)
    pages = np.array(seq.pages)[positions // prog.pcfg.page_size]
    per_layer = prog.pcfg.num_pages + 1
    flat = (np.arange(pools.k.shape[0] // per_layer)[:, None] * per_layer + pages[None, :])
    ring = () if pools.dk is None else (pools.dk[seq.slot], pools.dv[seq.slot])
    return [np.asarray(a) for a in (
        pools.conv[seq.slot], pools.rec[seq.slot], pools.ctx[seq.slot],
        pools.output_counts[seq.slot], pools.prompt_mask[seq.slot],
        pools.k[flat, positions % prog.pcfg.page_size],
        pools.v[flat, positions % prog.pcfg.page_size], *ring)] + [list(seq.tokens),
                                                                  seq.frontier]


def test_abort_leaves_committed_state_bit_identical_and_commit_advances():
    prog = program()
    ids = reference("dense")["token_ids"]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.5, seed=7)
    h = _admit(prog, ids[0, :11].tolist(), 8, sampled)
    run_to_completion(prog, {h: 2})
    before = _committed_state(prog, h)
    pb = prog.decode([h])
    proposed = pb.tokens.copy()
    prog.abort_pending(pb)
    after = _committed_state(prog, h)
    for x, y in zip(before, after):
        np.testing.assert_array_equal(np.asarray(x, dtype=object), np.asarray(y, dtype=object))
    pb = prog.decode([h])  # same state, same RNG stream index: the same proposal
    np.testing.assert_array_equal(pb.tokens, proposed)
    prog.commit(pb, [1])
    assert prog.tokens(h)[-1] == int(proposed[0, 0]) and prog._seq(h).frontier == before[-1] + 1
    with pytest.raises(PendingBatchError, match="not the Program's pending batch"):
        prog.commit(pb, [1])
    prog.release(h)
    _assert_all_free(prog)


def idle_keys(prog) -> list[StepKey]:
    """Every executable `Program.run_idle` runs: the commit and each decode round (every K,
    and the bare or lean rounds of 0)."""
    pcfg = prog.pcfg
    rounds = [round_key(pcfg, b, k) for b in range(1, pcfg.max_concurrency + 1)
              for k in pcfg.round_drafts]
    compiled = prog.executables.keys()
    return [StepKey(StepKind.COMMIT, pcfg.max_concurrency)] + rounds + sorted(
        (k for k in compiled if k.kind is StepKind.DECODE and k not in rounds), key=str)


def check_idle_runs_change_nothing(prog, prompts: list[list[int]], budget: int,
                                   sampling=None) -> list[list[int]]:
    """Decodes `prompts` together (`sampling` each, default greedy) with a checkpoint of the
    first; after the third round, with its commit deferred, runs every executable on the
    sink (`run_idle`): every sequence's committed state and the checkpoint's state stay
    bit-identical, and the outputs equal a run without them. Returns the outputs."""
    outputs = []
    for idle in (False, True):
        handles = [_admit(prog, p, budget, sampling) for p in prompts]
        for h in handles:
            while (pb := prog.prefill(h)) is None:
                pass
            prog.commit(pb, [1])
        ckpt = prog.capture(handles[0])
        for r in range(budget - 1):
            pb = prog.decode(handles)
            prog.commit(pb, [1] * len(handles))
            if idle and r == 2:
                before = [_committed_state(prog, h) for h in handles]
                slot = prog.checkpoints.record(ckpt).slot
                image = [np.asarray(a[slot]) for a in (prog.pools.ck_conv, prog.pools.ck_rec,
                                                        prog.pools.ck_ctx)]
                for key in idle_keys(prog):
                    prog.run_idle(key)
                after = [_committed_state(prog, h) for h in handles]
                for x, y in zip(before, after):
                    for a, b in zip(x, y):
                        np.testing.assert_array_equal(np.asarray(a, dtype=object),
                                                      np.asarray(b, dtype=object))
                for a, name in zip(image, ("ck_conv", "ck_rec", "ck_ctx")):
                    np.testing.assert_array_equal(a, np.asarray(getattr(prog.pools, name)[slot]))
        outputs.append([prog.tokens(h)[len(p):] for h, p in zip(handles, prompts)])
        for h in handles:
            prog.release(h)
        prog.release_checkpoint(ckpt)
    assert outputs[0] == outputs[1]
    _assert_all_free(prog)
    return outputs[0]


def test_idle_runs_on_the_sink_change_no_sequence_or_checkpoint():
    """What the Engine runs while idle to take executables' first runs out of requests."""
    prog = program()
    ids = reference("dense")["token_ids"]
    sampled = SamplingParams(temperature=0.8, top_p=0.9, presence_penalty=0.5, seed=7)
    check_idle_runs_change_nothing(prog, [ids[0, :11].tolist(), ids[1, :6].tolist(),
                                          ids[2, :9].tolist()], 8, sampled)
    assert prog.cold_rounds == 0 and not prog.warm_up_next()  # each ran once: none is cold
    h = _admit(prog, ids[0, :5].tolist(), 4)
    while (pb := prog.prefill(h)) is None:
        pass
    with pytest.raises(PendingBatchError, match="pending"):
        prog.run_idle(idle_keys(prog)[1])
    prog.commit(pb, [1])
    prog.release(h)
    _assert_all_free(prog)


def test_pending_batch_rules():
    prog = program()
    ids = reference("dense")["token_ids"]
    a, b = _admit(prog, ids[0, :5].tolist(), 4), _admit(prog, ids[1, :6].tolist(), 4)
    run_to_completion(prog, {a: 1, b: 1})
    pb = prog.decode([a, b])
    with pytest.raises(PendingBatchError, match="must be committed or aborted first"):
        prog.decode([a])
    with pytest.raises(PendingBatchError, match="while its PendingBatch is unconsumed"):
        prog.release(a)
    with pytest.raises(PendingBatchError, match="has 2 rows, got 1 decisions"):
        prog.commit(pb, [1])
    with pytest.raises(PendingBatchError, match=r"must be in 0..produced"):
        prog.commit(pb, [1, 2])
    prog.commit(pb, [1, 0])  # b cancelled: its state and tokens stay as before
    assert prog.num_generated(a) == 2 and prog.num_generated(b) == 1
    with pytest.raises(PendingBatchError, match="distinct sequences"):
        prog.decode([a, a])
    with pytest.raises(MissingExecutableError, match="no executable"):
        prog.executables(StepKey(StepKind.DECODE, 9))
    prog.release(a)
    prog.release(b)
    with pytest.raises(ResourceError, match="unknown or stale sequence handle"):
        prog.decode([a])
    _assert_all_free(prog)


def test_infeasible_or_stale_admission_is_refused_before_any_mutation():
    prog = program()
    before = prog.stats()
    with pytest.raises(InfeasibleError, match=r"60 \+ max_new_tokens 10 = 70 exceeds max_seq_len 64"):
        prog.plan_admission(60, 10)
    small = program(num_pages=8, max_concurrency=1)
    with pytest.raises(InfeasibleError, match=r"needs 10 pages of 4; the pool has 8 in total"):
        small.plan_admission(30, 10)
    with pytest.raises(InfeasibleError, match="max_new_tokens must be >= 1"):
        prog.plan_admission(3, 0)
    plan = prog.plan_admission(3, 3)
    other = _admit(prog, [1, 2, 3], 3)
    with pytest.raises(StalePlanError, match="sealed at revision"):
        prog.materialize(plan, [1, 2, 3])
    prog.release(other)
    with pytest.raises(InfeasibleError, match=r"prompt token ids must be in \[0, 384\)"):
        prog.materialize(prog.plan_admission(2, 2), [1, 384])
    after = prog.stats()
    assert dataclasses.replace(after, resource_revision=0) == dataclasses.replace(
        before, resource_revision=0)


def test_pools_are_donated_to_every_step():
    prog = program()
    h = _admit(prog, [5, 6, 7], 3)
    old = prog.pools
    run_to_completion(prog, {h: 2})
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(old))
    prog.release(h)


def test_seeded_sampling_is_independent_of_batch_neighbours():
    prog = program()
    ids = reference("dense")["token_ids"]
    sp = SamplingParams(temperature=1.0, top_k=50, seed=1234)
    alone = _admit(prog, ids[2, :7].tolist(), 6, sp)
    run_to_completion(prog, {alone: 6})
    want = prog.tokens(alone)
    prog.release(alone)
    hs = [_admit(prog, ids[r % 3, : 4 + r].tolist(), 6, SamplingParams(temperature=1.0, seed=r))
          for r in range(4)]
    target = _admit(prog, ids[2, :7].tolist(), 6, sp)
    run_to_completion(prog, {h: 6 for h in hs + [target]})
    assert prog.tokens(target) == want
    for h in hs + [target]:
        prog.release(h)
    _assert_all_free(prog)


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.sampled_from(["admit", "step", "cancel", "abort", "release"]),
                          st.integers(0, 10**6)), min_size=5, max_size=30))
def test_any_workload_leaves_every_page_and_slot_free(ops):
    prog = program()
    live, pending = [], None
    try:
        for op, r in ops:
            if op == "admit" and len(live) < PCFG.max_concurrency:
                plan = prog.plan_admission(1 + r % 20, 1 + r % 12)
                if prog.can_start(plan):
                    live.append(prog.materialize(plan, [r % 384] * plan.prompt_len))
            elif op in ("step", "cancel", "abort") and live:
                prefilling = [h for h in live if prog.is_prefilling(h)]
                ready = [h for h in live if not prog.is_prefilling(h)
                         and prog.num_generated(h) < prog._seq(h).max_new_tokens]
                if prefilling:
                    pending = prog.prefill(prefilling[r % len(prefilling)])
                elif ready:
                    pending = prog.decode(ready[: 1 + r % len(ready)])
                if pending is not None:
                    if op == "abort":
                        prog.abort_pending(pending)
                    else:
                        cancel = op == "cancel"
                        prog.commit(pending, [0 if cancel and i == 0 else 1
                                              for i in range(pending.batch)])
                    pending = None
            elif op == "release" and live:
                prog.release(live.pop(r % len(live)))
            s = prog.stats()
            assert s.free_pages + sum(len(prog._seq(h).pages) for h in live) == s.total_pages
            assert s.reserved_pages == sum(prog._seq(h).reserved for h in live)
    finally:
        for h in live:
            prog.release(h)
    _assert_all_free(prog)
