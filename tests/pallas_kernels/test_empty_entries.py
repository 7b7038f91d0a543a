"""`PagedAttentionInputs.skip_empty`: empty entries (zero key and value) are not read, by the
reference and by both kernels (interpret mode), float and INT8 pages, against dense numpy over
the positions left; an entry emptied in one kv head only is read by the others. Without
`skip_empty` the same entries are read as keys of logit 0 (their weight in the softmax's sum
changes the output).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    paged_attention_decode_pallas,
    paged_attention_decode_reference,
    paged_attention_prefill_pallas,
    paged_attention_prefill_reference,
)
from tests.pallas_kernels.test_int8_pages import _int8_pool
from tests.pallas_kernels.test_paged_attention import (
    NUM_KV_HEADS,
    TOLERANCES,
    DecodeCase,
    PrefillCase,
    make_decode_case,
    prefill_args,
)
from tests.pallas_kernels.test_prefill_kernel import make_batch


def _empty_some(k: np.ndarray, v: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Pools with about half of the written (page, offset, kv head) entries emptied (key and
    value zeros): in one head only, or in every head of a position."""
    rng = np.random.default_rng(seed)
    k, v = k.copy(), v.copy()
    written = ~np.isnan(k).any(axis=-1)  # [P, page_size, H_kv]
    empty = written & (rng.random(written.shape) < 0.35)
    whole = rng.random(written.shape[:2]) < 0.2  # every head of the position
    empty |= written & whole[..., None]
    k[empty], v[empty] = 0.0, 0.0
    return k, v


def _dense(q: np.ndarray, keys: np.ndarray, values: np.ndarray, visible: np.ndarray
           ) -> np.ndarray:
    """q [H_q, D] over keys/values [S, H_kv, D] where visible [S, H_kv] (float64)."""
    num_q_heads, head_dim = q.shape
    group = num_q_heads // NUM_KV_HEADS
    out = np.zeros((num_q_heads, head_dim))
    for head in range(num_q_heads):
        kv = head // group
        sel = visible[:, kv]
        if not sel.any():
            continue
        logits = keys[sel, kv].astype(np.float64) @ q[head].astype(np.float64) / np.sqrt(head_dim)
        weights = np.exp(logits - logits.max())
        out[head] = weights @ values[sel, kv].astype(np.float64) / weights.sum()
    return out


def dense_decode_skipping(case: DecodeCase) -> np.ndarray:
    page_size = case.k_pages.shape[1]
    out = []
    for row, length in enumerate(case.lengths):
        positions = np.arange(length)
        pages = case.page_tables[row, positions // page_size]
        keys = case.k_pages[pages, positions % page_size]
        values = case.v_pages[pages, positions % page_size]
        out.append(_dense(case.q[row], keys, values, keys.any(axis=-1)))
    return np.stack(out)


def dense_prefill_skipping(case: PrefillCase) -> np.ndarray:
    page_size = case.k_pages.shape[1]
    positions = np.arange(case.prior_len)
    pages, offsets = case.page_table[positions // page_size], positions % page_size
    cached_k, cached_v = case.k_pages[pages, offsets], case.v_pages[pages, offsets]
    keys = np.concatenate([cached_k, case.chunk_k[: case.chunk_len]])
    values = np.concatenate([cached_v, case.chunk_v[: case.chunk_len]])
    written = np.concatenate([cached_k.any(axis=-1),
                              np.ones((case.chunk_len, NUM_KV_HEADS), bool)])
    out = np.zeros(case.q.shape)
    for i in range(case.chunk_len):
        visible = written.copy()
        visible[case.prior_len + i + 1:] = False
        out[i] = _dense(case.q[i], keys, values, visible)
    return out


def _close(actual, expected, dtype) -> None:
    tol = TOLERANCES[dtype]
    np.testing.assert_allclose(np.asarray(actual, np.float32), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype, block_k", [(jnp.float32, 16), (jnp.bfloat16, 32)])
def test_decode_skips_empty_entries(dtype, block_k):
    reference = jax.jit(paged_attention_decode_reference)
    kernel = jax.jit(functools.partial(paged_attention_decode_pallas, block_k=block_k,
                                       interpret=True))
    for seed in (0, 1):
        case = make_decode_case(seed, group=2, head_dim=64, dtype=dtype)
        k, v = _empty_some(case.k_pages, case.v_pages, seed)
        case = dataclasses.replace(case, k_pages=k, v_pages=v)
        q, inputs = case.device_args(dtype)
        skipping = dataclasses.replace(inputs, skip_empty=True)
        want = dense_decode_skipping(case)
        _close(reference(q, skipping), want, dtype)
        _close(kernel(q, skipping), want, dtype)
        # read as keys without skip_empty
        reading = np.asarray(reference(q, inputs), np.float32)
        assert not np.allclose(reading, want, atol=0.05)


def test_prefill_skips_empty_cached_entries_not_the_chunk():
    reference = jax.jit(paged_attention_prefill_reference)
    kernel = jax.jit(functools.partial(paged_attention_prefill_pallas, interpret=True,
                                       block_m=16, block_c=16, block_k=16))
    cases = make_batch(2, tokens=6, group=3, head_dim=64, dtype=jnp.float32)
    k, v = _empty_some(cases[0].k_pages, cases[0].v_pages, 2)
    cases = [dataclasses.replace(c, k_pages=k, v_pages=v) for c in cases]
    q, inputs = prefill_args(cases)
    skipping = dataclasses.replace(inputs, skip_empty=True)
    ref, out = reference(q, skipping), kernel(q, skipping)
    for row, case in enumerate(cases):
        want = dense_prefill_skipping(case)
        _close(ref[row], want, jnp.float32)
        _close(out[row], want, jnp.float32)


def test_int8_pages_skip_entries_stored_as_zeros():
    """An empty entry of an INT8 pool is what the writer stores for zeros: int8 zeros, scale 0
    (`quant.quantize`)."""
    reference = jax.jit(paged_attention_decode_reference)
    kernel = jax.jit(functools.partial(paged_attention_decode_pallas, block_k=16,
                                       interpret=True))
    case = make_decode_case(3, group=2, head_dim=64, dtype=jnp.float32)
    k, v = _empty_some(case.k_pages, case.v_pages, 3)
    (kq, ks), (vq, vs) = _int8_pool(k, 3), _int8_pool(v, 4)
    assert not np.asarray(kq)[(k == 0).all(axis=-1)].any()
    assert not np.asarray(vs)[(v == 0).all(axis=-1)].any()
    q, floats = case.device_args(jnp.float32)
    int8 = dataclasses.replace(floats, k_pages=kq, v_pages=vq, k_scales=ks, v_scales=vs,
                               skip_empty=True)
    want = reference(q, int8)
    _close(kernel(q, int8), np.asarray(want), jnp.float32)
    # the same as the float pools it holds, dequantized
    deq = dataclasses.replace(case, k_pages=np.asarray(kq * np.asarray(ks)[..., None]),
                              v_pages=np.asarray(vq * np.asarray(vs)[..., None]))
    _close(want, dense_decode_skipping(deq), jnp.float32)
