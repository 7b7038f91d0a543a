"""Carried GDN state against transformers: one sequence longer than two GDN chunks
(`reference_long.npz`, 160 tokens; our `gdn_chunk_size` and transformers' chunk are both 64, and
the jnp form on XLA:CPU runs in chunks of 32), so
the state handed from GDN chunk to GDN chunk, and from prefill chunk to prefill chunk, is checked
against transformers' logits and greedy tokens rather than only against our own other paths.

Three ways through the same weights: the full forward (GDN chunks inside one call), `step` over
prefill chunks of 24 tokens (the state carried between calls), and the Program (paged KV,
state slots, staged prefill, then decode) reproducing transformers' greedy continuation.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.models.qwen3_6 import ContiguousKV, GDNState, step
from ninfer_jax.program.executables import StepKey, StepKind
from ninfer_jax.program.host import GREEDY
from tests.conftest import FIXTURES
from tests.models.conftest import jit_static_cfg, loaded, rel_err
from tests.program.conftest import program

_step = jit_static_cfg(step)


@functools.cache
def long_reference(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "reference_long.npz") as f:
        return dict(f)


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_fixture_spans_more_than_two_gdn_chunks(name):
    ref = long_reference(name)
    chunk = loaded(name).config.gdn_chunk_size
    assert ref["token_ids"].shape[1] > 2 * chunk
    assert {chunk - 1, chunk, 2 * chunk - 1, 2 * chunk} <= set(ref["positions"].tolist())
    assert ref["greedy_min_margin"] >= 0.01  # greedy steps decided far above fp32 noise


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_full_forward_matches_transformers_across_gdn_chunks(name):
    ref = long_reference(name)
    logits = loaded(name).logits(ref["token_ids"])[:, ref["positions"]]
    assert rel_err(logits, ref["logits"]) <= 1e-4


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_prefill_chunks_carry_the_state_as_transformers_does(name):
    """Chunks of 24: their ends fall inside GDN chunks, and GDN chunks end inside them."""
    model = loaded(name)
    cfg, params = model.config, model.params
    ref = long_reference(name)
    ids = ref["token_ids"]
    total, chunk = ids.shape[1], 24
    gdn, kv = GDNState.zeros(cfg, 1), ContiguousKV.zeros(cfg, 1, max_len=total)
    got = []
    for start in range(0, total, chunk):
        piece = ids[:, start : start + chunk]
        out = _step(params, cfg, jnp.asarray(piece), kv.lengths, gdn, kv)
        got.append(np.asarray(out.logits))
        gdn, kv = out.gdn, out.kv.advance(jnp.full((1,), piece.shape[1], jnp.int32))
    logits = np.concatenate(got, axis=1)[:, ref["positions"]]
    assert rel_err(logits, ref["logits"]) <= 1e-4


class _Recorded:
    """The Program's real executable table, noting the log-probability of every token a prefill
    chunk or decode step picks (the Program itself keeps only the tokens)."""

    def __init__(self, table):
        self.table, self.logprobs = table, []

    def __call__(self, key: StepKey, *args):
        result = self.table(key, *args)
        if key.kind in (StepKind.PREFILL, StepKind.DECODE):
            self.logprobs.append(float(np.asarray(result[1].logprobs)[0, 0]))
        return result


@pytest.mark.parametrize("name", ["dense", pytest.param("moe", marks=pytest.mark.slow)])
def test_program_staged_prefill_then_decode_matches_transformers(name):
    """prefill_chunk 24: seven chunks through the pools (paged K/V, the state slot carried from
    chunk to chunk), then greedy decode. Each chunk's last position and each decode step are
    compared with transformers: the greedy token and its log-probability."""
    ref = long_reference(name)
    prompt = ref["token_ids"][0].tolist()
    want = ref["greedy_tokens"][0].tolist()
    prog = program(name, max_concurrency=1, page_size=16, num_pages=12, max_seq_len=192,
                   prefill_chunk=24, num_checkpoint_slots=0)
    recorded = _Recorded(prog.executables)
    prog.executables = recorded
    handle = prog.materialize(prog.plan_admission(len(prompt), len(want)), prompt, GREEDY)
    try:
        while (batch := prog.prefill(handle)) is None:
            pass
        prog.commit(batch, [1])
        while prog.num_generated(handle) < len(want):
            prog.commit(prog.decode([handle]), [1])
        assert prog.tokens(handle)[len(prompt):] == want
    finally:
        prog.release(handle)
        prog.executables = recorded.table
    ends = list(range(23, len(prompt), 24)) + [len(prompt) - 1]
    at = [ref["positions"].tolist().index(e) for e in ends]
    logits = ref["logits"][0, at].astype(np.float64)  # greedy: log p(argmax) = -log sum e^(l-max)
    chunk_ends = -np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))
    # The last chunk's token is the first greedy token; the decode steps give the others.
    want_logprobs = np.concatenate([chunk_ends, ref["greedy_logprobs"][1:]])
    got = np.array(recorded.logprobs)
    assert got.shape == want_logprobs.shape == (len(ends) + len(want) - 1,)
    np.testing.assert_allclose(got, want_logprobs, rtol=0, atol=1e-4)
