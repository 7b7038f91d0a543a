"""Carried state: prefill + decode equals the full forward; chunked GDN equals recurrent GDN."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax.models.qwen3_6 import ContiguousKV, GDNState, forward, step
from ninfer_jax.models.qwen3_6.gdn import (
    _inverse_unit_lower,
    chunked_delta_rule,
    recurrent_delta_rule,
)
from tests.models.conftest import jit_static_cfg, loaded, reference, rel_err

_step = jit_static_cfg(step)


def _full(model, ids):
    return model.logits(np.asarray(ids))


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_prefill_then_decode_equals_full_forward(name):
    model = loaded(name)
    cfg, params = model.config, model.params
    ids = jnp.asarray(reference(name)["token_ids"])
    b, t1, t2 = ids.shape[0], 13, 11
    full = _full(model, ids[:, : t1 + t2])
    out = _step(params, cfg, ids[:, :t1], jnp.zeros((b,), jnp.int32),
                GDNState.zeros(cfg, b), ContiguousKV.zeros(cfg, b, max_len=64))
    got = [out.logits]
    kv = out.kv.advance(jnp.full((b,), t1, jnp.int32))
    gdn = out.gdn
    for i in range(t2):
        pos = jnp.full((b,), t1 + i, jnp.int32)
        out = _step(params, cfg, ids[:, t1 + i : t1 + i + 1], pos, gdn, kv)
        got.append(out.logits)
        gdn, kv = out.gdn, out.kv.advance(jnp.ones((b,), jnp.int32))
    assert rel_err(np.concatenate(got, axis=1), full) <= 1e-5


@pytest.mark.parametrize("name", ["dense", pytest.param("moe", marks=pytest.mark.slow)])
def test_padded_chunks_with_ragged_rows_then_decode_match_each_row_alone(name):
    """Fixed-size chunks, the last one padded per row (num_valid), rows of different lengths."""
    model = loaded(name)
    cfg, params = model.config, model.params
    ids = np.asarray(reference(name)["token_ids"])
    lens = np.array([13, 7, 20], np.int32)
    chunk, b = 8, 3
    gdn, kv = GDNState.zeros(cfg, b), ContiguousKV.zeros(cfg, b, max_len=64)
    last = [None] * b
    for c in range(0, int(lens.max()), chunk):
        num_valid = np.clip(lens - c, 0, chunk).astype(np.int32)
        out = _step(params, cfg, jnp.asarray(ids[:, c : c + chunk]), kv.lengths, gdn, kv,
                    jnp.asarray(num_valid))
        for r in range(b):
            if num_valid[r] > 0:
                last[r] = np.asarray(out.logits[r, num_valid[r] - 1])
        gdn, kv = out.gdn, out.kv.advance(jnp.asarray(num_valid))
    decoded = []
    tokens = np.array([ids[r, lens[r]] for r in range(b)], np.int32)[:, None]
    for _ in range(4):
        out = _step(params, cfg, jnp.asarray(tokens), kv.lengths, gdn, kv)
        decoded.append(np.asarray(out.logits[:, 0]))
        gdn, kv = out.gdn, out.kv.advance(jnp.ones((b,), jnp.int32))
        tokens = np.asarray(out.logits[:, 0]).argmax(-1).astype(np.int32)[:, None]
    for r in range(b):
        seq = list(ids[r, : lens[r] + 1])
        for d in decoded[:-1]:
            seq.append(int(d[r].argmax()))
        alone = _full(model, np.array([seq]))[0]
        assert rel_err(last[r], alone[lens[r] - 1]) <= 1e-5
        for j, d in enumerate(decoded):
            assert rel_err(d[r], alone[lens[r] + j]) <= 1e-5


def _random_gdn_inputs(seed, b=2, t=45, h=3, dk=16, dv=24):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, dk)).astype(np.float32)
    k = rng.standard_normal((b, t, h, dk)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True) * np.sqrt(dk)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((b, t, h, dv)).astype(np.float32)
    g = -rng.uniform(0.0, 0.7, (b, t, h)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (b, t, h)).astype(np.float32)
    s0 = rng.standard_normal((b, h, dk, dv)).astype(np.float32) * 0.3
    return tuple(map(jnp.asarray, (q, k, v, g, beta, s0)))


@pytest.mark.parametrize("seed,chunk", [(0, 16), (1, 8), (2, 64), (3, 32)])
def test_chunked_delta_rule_equals_recurrent(seed, chunk):
    q, k, v, g, beta, s0 = _random_gdn_inputs(seed)
    assert q.shape[1] % chunk != 0
    out_r, s_r = jax.jit(recurrent_delta_rule)(q, k, v, g, beta, s0)
    out_c, s_c = jax.jit(chunked_delta_rule, static_argnums=6)(q, k, v, g, beta, s0, chunk)
    assert rel_err(out_c, out_r) <= 1e-5
    assert rel_err(s_c, s_r) <= 1e-5


@pytest.mark.parametrize("c", [8, 16, 32, 64, 128, 48])
def test_blocked_unit_lower_inverse_equals_the_inverse(c):
    rng = np.random.default_rng(c)
    a = np.tril(rng.standard_normal((2, 3, c, c)).astype(np.float32) * 0.3, -1)
    want = np.linalg.inv(np.eye(c) - a.astype(np.float64))
    got = np.asarray(jax.jit(_inverse_unit_lower)(jnp.asarray(a)))
    assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_chunk_size_does_not_change_the_model():
    model = loaded("dense")
    ids = reference("dense")["token_ids"]
    small = dataclasses.replace(model.config, gdn_chunk_size=8)
    got = jit_static_cfg(forward)(model.params, small, jnp.asarray(ids))
    assert rel_err(got, model.logits(ids)) <= 1e-5


def test_the_cpu_chunk_gives_the_model_of_its_own_chunk(monkeypatch):
    """On XLA:CPU the jnp chunked form runs in chunks of CPU_CHUNK (32) rather than the model's
    gdn_chunk_size (64 here): the same logits as in chunks of 64."""
    from ninfer_jax.models.qwen3_6 import gdn

    model = loaded("dense")
    assert model.config.gdn_chunk_size == 64 and gdn.reference_chunk(model.config) == 32
    ids = jnp.asarray(reference("dense")["token_ids"])
    cpu = jax.jit(lambda p, i: forward(p, model.config, i))(model.params, ids)
    monkeypatch.setattr(gdn, "CPU_CHUNK", 64)  # a new function: traced again
    model_chunk = jax.jit(lambda p, i: forward(p, model.config, i))(model.params, ids)
    assert rel_err(cpu, model_chunk) <= 1e-5


@pytest.mark.parametrize("seed,chunk,lens", [
    (0, 16, [5, 19, 1, 13]),  # segments inside a chunk, across one, and of one token
    (1, 8, [8, 8, 16, 7]),  # segments on chunk boundaries
    (2, 64, [45]),  # one segment: the plain rule
])
def test_a_segment_restarts_the_state_as_if_it_ran_alone(seed, chunk, lens):
    """A packed row: every segment's outputs equal the recurrent rule over that segment alone
    from zero state (the first from the row's state); the state after the row is the last
    segment's, padding after it changing nothing."""
    q, k, v, g, beta, s0 = _random_gdn_inputs(seed)
    t = q.shape[1]
    pad = t - sum(lens)
    segments = np.repeat(np.arange(len(lens)), lens)
    segments = np.concatenate([segments, np.full(pad, len(lens) - 1)]).astype(np.int32)
    valid = (np.arange(t) < sum(lens))[None, :, None]
    g, beta = jnp.where(valid, g, 0.0), jnp.where(valid, beta, 0.0)
    segs = jnp.asarray(np.broadcast_to(segments, (q.shape[0], t)))
    out, state = jax.jit(chunked_delta_rule, static_argnums=6)(q, k, v, g, beta, s0, chunk, segs)
    at = 0
    for i, n in enumerate(lens):
        part = slice(at, at + n)
        start = s0 if i == 0 else jnp.zeros_like(s0)
        want, want_state = recurrent_delta_rule(q[:, part], k[:, part], v[:, part],
                                                g[:, part], beta[:, part], start)
        assert rel_err(out[:, part], want) <= 1e-5, i
        at += n
    assert rel_err(state, want_state) <= 1e-5


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_a_packed_row_scores_every_text_as_if_alone(name):
    """The decoder stack over one row holding three texts (segments: GDN state restarts, the
    conv and attention see their own text only, positions restart) equals each text's own
    forward."""
    from ninfer_jax.models.qwen3_6 import CausalKV, SegmentedCausalKV
    from ninfer_jax.models.qwen3_6.model import run_layers

    model = loaded(name)
    cfg, params = model.config, model.params
    ids = reference(name)["token_ids"]
    texts = [ids[0, :7], ids[1, :20], ids[2, :9]]
    row = np.concatenate(texts)[None].astype(np.int32)
    segments = np.repeat(np.arange(3), [len(t) for t in texts])[None].astype(np.int32)
    positions = np.concatenate([np.arange(len(t)) for t in texts])[None].astype(np.int32)

    def packed(params, row, positions, segments):
        h, _, _, _ = run_layers(params, cfg, params["embed"][row], positions,
                                GDNState.zeros(cfg, 1), SegmentedCausalKV(segments), None,
                                segments=segments)
        return h

    def alone(params, row):
        h, _, _, _ = run_layers(params, cfg, params["embed"][row],
                                jnp.arange(row.shape[1])[None], GDNState.zeros(cfg, 1),
                                CausalKV(), None)
        return h

    got = np.asarray(jax.jit(packed)(params, row, positions, segments))[0]
    at = 0
    for t in texts:
        want = np.asarray(jax.jit(alone)(params, t[None].astype(np.int32)))[0]
        assert rel_err(got[at : at + len(t)], want) <= 1e-5
        at += len(t)
