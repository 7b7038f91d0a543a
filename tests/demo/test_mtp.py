"""The MTP head: which input feeds which half of `fc`, and cached decoding equals one full call."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.models.qwen3_6 import CausalKV, ContiguousKV
from ninfer_jax.models.qwen3_6.mtp import mtp_step
from ninfer_jax.models.qwen3_6.weights import init_params
from ninfer_jax.testing.configs import tiny_dense

CFG = tiny_dense(mtp_num_layers=1)
T = 9


def _inputs(seed: int):
    k1, k2 = jax.random.split(jax.random.key(seed))
    hidden = jax.random.normal(k1, (2, T, CFG.hidden_size))
    next_ids = jax.random.randint(k2, (2, T), 0, CFG.vocab_size)
    return hidden, next_ids


def _params():
    params = init_params(CFG, jax.random.key(0), num_mtp_layers=1, std=0.2)
    return jax.tree.map(lambda a: a + 0.3 if a.ndim == 1 else a, params)


@functools.partial(jax.jit, static_argnums=())
def _full(params, hidden, next_ids):
    return mtp_step(params, CFG, hidden, next_ids, jnp.zeros((2,), jnp.int32), CausalKV())[0]


def test_fc_takes_the_embedding_first_and_the_hidden_state_second():
    params = _params()
    h = CFG.hidden_size
    hidden, next_ids = _inputs(1)
    other_hidden, other_ids = _inputs(2)
    no_embed = {**params, "mtp": {**params["mtp"], "fc": params["mtp"]["fc"].at[:, :h].set(0)}}
    np.testing.assert_array_equal(_full(no_embed, hidden, next_ids),
                                  _full(no_embed, hidden, other_ids))
    no_hidden = {**params, "mtp": {**params["mtp"], "fc": params["mtp"]["fc"].at[:, h:].set(0)}}
    np.testing.assert_array_equal(_full(no_hidden, hidden, next_ids),
                                  _full(no_hidden, other_hidden, next_ids))
    assert not np.allclose(_full(params, hidden, next_ids), _full(params, other_hidden, next_ids))


def test_prefill_then_token_by_token_with_a_cache_equals_one_full_call():
    params = _params()
    hidden, next_ids = _inputs(3)
    want = _full(params, hidden, next_ids)
    run = jax.jit(functools.partial(mtp_step, cfg=CFG))
    shape = (1, 2, T, CFG.num_kv_heads, CFG.head_dim)
    kv = ContiguousKV(layers=(jnp.zeros(shape), jnp.zeros(shape)), lengths=jnp.zeros((2,), jnp.int32))
    split = 4
    got, kv = run(params, hidden=hidden[:, :split], next_token_ids=next_ids[:, :split],
                  start_pos=kv.lengths, kv=kv)
    pieces = [got]
    kv = kv.advance(jnp.full((2,), split, jnp.int32))
    for t in range(split, T):
        got, kv = run(params, hidden=hidden[:, t:t + 1], next_token_ids=next_ids[:, t:t + 1],
                      start_pos=kv.lengths, kv=kv)
        pieces.append(got)
        kv = kv.advance(jnp.ones((2,), jnp.int32))
    np.testing.assert_allclose(jnp.concatenate(pieces, axis=1), want, atol=2e-5, rtol=1e-5)
