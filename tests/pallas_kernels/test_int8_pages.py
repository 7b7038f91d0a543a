"""INT8 K/V pages: the quantization's exact properties; the decode and prefill kernels
(interpret mode) on int8 pages and scales against the jnp reference on the same pages; the
int8 reference against the float reference on the dequantized pages; CUDA lowering with the
int8 pool inside the Triton call; and the contract's errors.

Pool slots no valid position reads hold random int8 values and NaN scales, so a leak of a
masked or stale position into an output is a mismatch.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    PagedAttentionInputs,
    dequantize,
    paged_attention_decode,
    paged_attention_decode_pallas,
    paged_attention_decode_reference,
    paged_attention_prefill,
    paged_attention_prefill_pallas,
    quantize,
)
from tests.pallas_kernels.test_paged_attention import (
    TOLERANCES,
    _triton_custom_call_target,
    make_decode_case,
    prefill_args,
)
from tests.pallas_kernels.test_prefill_kernel import make_batch


def _int8_pool(pages: np.ndarray, seed: int):
    """Float pages (NaN where unread) -> (int8 pages, float32 scales): quantized where read,
    random values and NaN scales elsewhere."""
    unread = np.isnan(pages).any(axis=-1)
    q, s = (np.array(a) for a in quantize(jnp.asarray(np.nan_to_num(pages), jnp.float32)))
    q[unread] = np.random.default_rng(seed).integers(-127, 128, (unread.sum(), pages.shape[-1]))
    s[unread] = np.nan
    return jnp.asarray(q), jnp.asarray(s)


def test_quantize_is_symmetric_per_vector_and_rounds_to_nearest():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 3, 64)).astype(np.float32) * rng.uniform(0.01, 30, (5, 3, 1))
    x[1, 2] = 0.0  # a zero vector: scale 0, reads back as zeros
    x[2, 0, 7] = -np.abs(x[2, 0]).max() * 2  # the extreme is negative
    q, s = quantize(jnp.asarray(x))
    q, s = np.asarray(q), np.asarray(s)
    assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == (5, 3)
    np.testing.assert_allclose(s, np.abs(x).max(-1) / 127, rtol=1e-7)
    assert s[1, 2] == 0 and not q[1, 2].any() and q.min() >= -127
    assert (np.abs(q).max(-1)[s > 0] == 127).all()  # each vector's extreme is +-127
    back = np.asarray(dequantize(jnp.asarray(q), jnp.asarray(s)))
    assert not back[1, 2].any()
    # round to nearest: within half a step (plus the fp32 product's rounding)
    assert (np.abs(back - x) <= s[..., None] * (0.5 + 1e-5) + 1e-30).all()
    np.testing.assert_array_equal(q, np.round(x / np.where(s > 0, s, 1)[..., None]))


# Interpret-mode compiles take seconds each: the default tier runs one decode config (fp32) and
# two prefill configs (an fp32 chunk, a bf16 verify window; bf16 goes through the same
# `load_keys`), the slow tier the rest.
SLOW = pytest.mark.slow
# group x head_dim x compute dtype x block_k (keys per step)
DECODE_CONFIGS = [(1, 64, jnp.float32, 16), pytest.param(4, 128, jnp.float32, None, marks=SLOW),
                  pytest.param(2, 64, jnp.bfloat16, 32, marks=SLOW),
                  pytest.param(8, 128, jnp.bfloat16, 16, marks=SLOW)]


@pytest.mark.parametrize("group, head_dim, dtype, block_k", DECODE_CONFIGS)
def test_decode_kernel_on_int8_pages_matches_the_reference(group, head_dim, dtype, block_k):
    kernel = jax.jit(functools.partial(paged_attention_decode_pallas, block_k=block_k,
                                       interpret=True))
    reference = jax.jit(paged_attention_decode_reference)
    tol = TOLERANCES[dtype]
    for seed in (0, 1):  # each seed shuffles the ragged rows
        case = make_decode_case(seed, group=group, head_dim=head_dim, dtype=jnp.float32)
        (kq, ks), (vq, vs) = _int8_pool(case.k_pages, seed), _int8_pool(case.v_pages, seed + 7)
        q, floats = case.device_args(dtype)
        int8 = dataclasses.replace(floats, k_pages=kq, v_pages=vq, k_scales=ks, v_scales=vs)
        want, out = reference(q, int8), kernel(q, int8)
        assert out.dtype == dtype and want.dtype == dtype
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                                   atol=tol, rtol=tol)
        assert not np.asarray(out)[case.lengths == 0].any(), "length-0 rows must be zero"
        # The float reference on the pages dequantized (in q's dtype, as the kernels do; NaN
        # where unread): the same numbers.
        plain = reference(q, dataclasses.replace(floats, k_pages=dequantize(kq, ks, dtype),
                                                 v_pages=dequantize(vq, vs, dtype)))
        np.testing.assert_allclose(np.asarray(want, np.float32), np.asarray(plain, np.float32),
                                   atol=1e-6, rtol=1e-6)


# tokens x group x head_dim x dtype x blocks: a chunk, a verify window, bf16
PREFILL_CONFIGS = [pytest.param(8, 1, 64, jnp.float32, {"block_k": 16}, marks=SLOW),
                   (20, 3, 64, jnp.float32, {"block_m": 16, "block_c": 16, "block_k": 16}),
                   (4, 8, 64, jnp.bfloat16, {"block_m": 16, "block_k": 32})]


@pytest.mark.parametrize("tokens, group, head_dim, dtype, blocks", PREFILL_CONFIGS)
def test_prefill_kernel_on_int8_pages_matches_the_reference(tokens, group, head_dim, dtype,
                                                           blocks):
    kernel = jax.jit(functools.partial(paged_attention_prefill_pallas, interpret=True, **blocks))
    reference = jax.jit(functools.partial(paged_attention_prefill, impl="reference"))
    tol = TOLERANCES[dtype]
    cases = make_batch(3, tokens=tokens, group=group, head_dim=head_dim, dtype=jnp.float32)
    (kq, ks), (vq, vs) = _int8_pool(cases[0].k_pages, 3), _int8_pool(cases[0].v_pages, 4)
    q, floats = prefill_args(cases, dtype)
    # the chunks' own K/V as a writer of int8 pages passes them: quantized and dequantized
    ck, cv = (dequantize(*quantize(jnp.asarray(np.stack([getattr(c, name) for c in cases]))),
                         dtype) for name in ("chunk_k", "chunk_v"))
    int8 = dataclasses.replace(floats, k_pages=kq, v_pages=vq, k_scales=ks, v_scales=vs,
                               chunk_k=ck, chunk_v=cv)
    want, out = reference(q, int8), kernel(q, int8)
    assert out.dtype == dtype
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                               atol=tol, rtol=tol)
    for row, case in enumerate(cases):
        assert not np.asarray(out[row, case.chunk_len:]).any(), "padding rows are zero"
    plain = reference(q, dataclasses.replace(int8, k_pages=dequantize(kq, ks, dtype),
                                             v_pages=dequantize(vq, vs, dtype), k_scales=None,
                                             v_scales=None))
    np.testing.assert_allclose(np.asarray(want, np.float32), np.asarray(plain, np.float32),
                               atol=1e-6, rtol=1e-6)


def test_kernels_lower_to_triton_for_cuda_with_the_int8_pool_inside():
    """Qwen3.6-like shapes (24 q / 4 kv heads x 256, page 16, bf16 queries): one Triton call,
    taking the int8 pool and its scales; nothing outside it makes a float pool."""
    s = jax.ShapeDtypeStruct
    batch, tokens, num_pages, heads = 3, 48, 37, 4
    pool, scales = s((num_pages, 16, heads, 256), jnp.int8), s((num_pages, 16, heads), jnp.float32)
    float_pool = f"tensor<{num_pages}x16x{heads}x256xbf16>"
    pages = PagedAttentionInputs(pool, pool, s((batch, 5), jnp.int32), s((batch,), jnp.int32),
                                 scales, scales)
    chunk = s((batch, tokens, heads, 256), jnp.bfloat16)
    decode = (s((batch, 24, 256), jnp.bfloat16), pages)
    prefill = (s((batch, tokens, 24, 256), jnp.bfloat16),
               dataclasses.replace(pages, chunk_k=chunk, chunk_v=chunk,
                                   chunk_lens=s((batch,), jnp.int32)))
    for fn, args in ((paged_attention_decode, decode), (paged_attention_prefill, prefill)):
        step = jax.jit(functools.partial(fn, impl="pallas"))
        text = step.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        call = [line for line in text.splitlines()
                if f"custom_call @{_triton_custom_call_target()}" in line]
        assert len(call) == 1, fn.__name__
        assert f"tensor<{num_pages}x16x{heads}x256xi8>" in call[0]
        assert f"tensor<{num_pages}x16x{heads}xf32>" in call[0]
        assert float_pool not in text


@pytest.mark.parametrize("impl", ["reference", "pallas"])
def test_bad_int8_inputs_name_the_argument(impl):
    case = make_decode_case(0, group=2, head_dim=64, dtype=jnp.float32)
    q, floats = case.device_args(jnp.float32)
    (kq, ks), (vq, vs) = quantize(floats.k_pages), quantize(floats.v_pages)
    int8 = dataclasses.replace(floats, k_pages=kq, v_pages=vq)
    decode = functools.partial(paged_attention_decode, impl=impl, interpret=True)
    for inputs, message in [
        (int8, "int8 k_pages/v_pages need k_scales and v_scales"),
        (dataclasses.replace(floats, k_scales=ks, v_scales=vs),
         "k_scales/v_scales are for int8 pages"),
        (dataclasses.replace(int8, k_scales=ks), "need both k_scales and v_scales"),
        (dataclasses.replace(int8, k_scales=ks[:, :4], v_scales=vs),
         r"k_scales must be floats of shape \[num_pages, page_size, num_kv_heads\]"),
        (dataclasses.replace(int8, k_scales=ks, v_scales=vq[..., 0]), "v_scales must be floats"),
    ]:
        with pytest.raises(ValueError, match=message):
            jax.jit(decode).trace(q, inputs)
