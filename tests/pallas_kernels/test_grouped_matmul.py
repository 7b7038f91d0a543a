"""The grouped matmul kernel (interpret mode) against its dense reference: ragged groups, empty
experts, one expert with every row, gathered rows, the fused SwiGLU, stacked layers, a device's
share of the experts, int8/int4/fp8 weights, fp32 and bf16; that it never reads an expert
without rows (their weights NaN, the result finite); its tile table; its CUDA lowering."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ninfer_jax import quant
from pallas_kernels.grouped_matmul import (
    grouped_matmul,
    grouped_matmul_reference,
    num_tiles,
    tile_table,
)
from tests.pallas_kernels.test_paged_attention import _triton_custom_call_target

TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}


def _weights(rng, e, n, k, method, layers=None):
    lead = (e,) if layers is None else (layers, e)
    w = (rng.standard_normal((*lead, n, k)) * 0.1).astype(np.float32)
    if method is None:
        return w
    q = quant.quantize_int(w, method) if method != "fp8" else quant.fp8_blocks(w)
    return jax.tree.map(jnp.asarray, q)


def _case(rng, sizes, k_dim, dtype):
    m = int(sum(sizes))
    lhs = jnp.asarray(rng.standard_normal((m, k_dim)), dtype)
    return lhs, jnp.asarray(sizes, jnp.int32)


def _check(got, want, dtype):
    tol = TOLERANCE[dtype]
    assert got.shape == want.shape and got.dtype == want.dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=tol, atol=tol)


SIZES = {
    "ragged": [3, 0, 17, 1, 0, 9, 2, 0],  # empty experts, partial and multi-tile groups
    "one expert takes every row": [0, 0, 0, 40, 0, 0, 0, 0],
    "one row each": [1, 1, 1, 1, 1, 1, 1, 1],
    "no rows": [0, 0, 0, 0, 0, 0, 0, 0],
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("case", sorted(SIZES))
def test_sorted_rows_equal_the_reference(case, dtype):
    rng = np.random.default_rng(len(case))
    lhs, sizes = _case(rng, SIZES[case], 64, dtype)
    w = _weights(rng, 8, 32, 64, None).astype(np.dtype(dtype))
    got = grouped_matmul(lhs, w, sizes, interpret=True)
    _check(got, grouped_matmul_reference(lhs, w, sizes), dtype)


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_quantized_swiglu_over_gathered_rows_equals_the_reference(method, dtype):
    """Tokens [T, K] gathered by row id in the kernel (each token's k experts), the fused
    SwiGLU of gate and up, with quantized weights dequantized tile by tile."""
    rng = np.random.default_rng(7)
    e, t, k, n, k_dim = 8, 11, 3, 128, 256
    top = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])
    order = np.argsort(top.reshape(-1), kind="stable")
    row_ids = jnp.asarray(order // k, jnp.int32)
    sizes = jnp.asarray(np.bincount(top.reshape(-1), minlength=e), jnp.int32)
    x = jnp.asarray(rng.standard_normal((t, k_dim)), dtype)
    gate, up = _weights(rng, e, n, k_dim, method), _weights(rng, e, n, k_dim, method)
    got = grouped_matmul(x, gate, sizes, w_up=up, row_ids=row_ids, interpret=True)
    want = grouped_matmul_reference(x, gate, sizes, w_up=up, row_ids=row_ids)
    _check(got, want, dtype)
    dense = grouped_matmul_reference(x, quant.dequantize_params({"g": gate})["g"], sizes,
                                     w_up=quant.dequantize_params({"u": up})["u"],
                                     row_ids=row_ids)
    _check(want, dense, dtype)  # the reference applies the QArray's own dequantize


def test_a_stacked_layer_is_indexed_in_the_kernel():
    rng = np.random.default_rng(3)
    lhs, sizes = _case(rng, [5, 0, 20, 3], 64, jnp.float32)
    w = _weights(rng, 4, 48, 64, "int8", layers=3)
    for layer in range(3):
        index = jnp.asarray([layer], jnp.int32)
        got = grouped_matmul(lhs, w, sizes, layer=index, interpret=True)
        _check(got, grouped_matmul_reference(lhs, w[layer], sizes), jnp.float32)


def test_each_devices_share_of_experts_sums_to_the_whole():
    """`expert_offset`: a device holding experts [o, o + n) computes their rows and zeros for
    the rest, so the shares of a mesh that splits the experts sum to the result."""
    rng = np.random.default_rng(5)
    lhs, sizes = _case(rng, SIZES["ragged"], 64, jnp.float32)
    w, up = _weights(rng, 8, 32, 64, None), _weights(rng, 8, 32, 64, None)
    whole = grouped_matmul_reference(lhs, w, sizes, w_up=up)
    shares = [grouped_matmul(lhs, w[o:o + 2], sizes, w_up=up[o:o + 2],
                             expert_offset=jnp.asarray([o], jnp.int32), interpret=True)
              for o in range(0, 8, 2)]
    _check(sum(shares), whole, jnp.float32)
    rows = np.repeat(np.arange(8), SIZES["ragged"])
    assert not np.asarray(shares[1])[(rows < 2) | (rows >= 4)].any()  # others' rows: zero


@pytest.mark.parametrize("method", [None, "int4"])
def test_experts_without_rows_are_never_read(method):
    """Every weight of an expert with no rows is NaN (int4: its scales): a kernel that read
    one would put NaN in the result."""
    rng = np.random.default_rng(11)
    sizes = [4, 0, 0, 9, 0, 1, 0, 0]
    lhs, sizes_arr = _case(rng, sizes, 128, jnp.float32)
    w = _weights(rng, 8, 32, 128, method)
    empty = np.asarray(sizes) == 0
    if method is None:
        poisoned = np.where(empty[:, None, None], np.nan, w)
    else:
        poisoned = quant.QArray(w.q, jnp.where(empty[:, None, None], jnp.nan, w.scale),
                                w.method, w.block)
    got = np.asarray(grouped_matmul(lhs, poisoned, sizes_arr, interpret=True))
    assert np.isfinite(got).all()
    _check(got, grouped_matmul_reference(lhs, w, sizes_arr), jnp.float32)


def test_tiles_never_straddle_two_experts():
    sizes = np.array([3, 0, 17, 1, 0, 33], np.int32)
    block = 16
    table = np.asarray(tile_table(jnp.asarray(sizes), int(sizes.sum()), block))
    assert table.shape == (num_tiles(int(sizes.sum()), len(sizes), block), 3)
    starts = np.cumsum(sizes) - sizes
    used = table[table[:, 2] > table[:, 1]]
    assert len(used) == sum(-(-s // block) for s in sizes)  # an empty expert has no tile
    for expert, first, end in used:
        assert starts[expert] <= first < end <= starts[expert] + sizes[expert]
        assert end - first <= block
    covered = np.concatenate([np.arange(f, e) for _, f, e in used])
    np.testing.assert_array_equal(np.sort(covered), np.arange(sizes.sum()))


def test_bad_arguments_are_refused_naming_them():
    w = jnp.ones((4, 32, 64), jnp.float32)
    with pytest.raises(ValueError, match="w must be"):
        grouped_matmul(jnp.ones((3, 48)), w, jnp.ones(4, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="group_sizes must be"):
        grouped_matmul(jnp.ones((3, 64)), w, jnp.ones(5, jnp.int32), interpret=True)
    with pytest.raises(ValueError, match="w_up must be"):
        grouped_matmul(jnp.ones((3, 64)), w, jnp.ones(4, jnp.int32),
                       w_up=jnp.ones((4, 16, 64)), interpret=True)


@pytest.mark.parametrize("method", [None, "int8", "int4", "fp8"])
def test_lowers_for_cuda_as_a_triton_kernel(method):
    rng = np.random.default_rng(0)
    w = _weights(rng, 8, 128, 256, method, layers=2)
    w = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), w)
    x = jax.ShapeDtypeStruct((6, 256), jnp.bfloat16)
    ids = jax.ShapeDtypeStruct((12,), jnp.int32)
    sizes = jax.ShapeDtypeStruct((8,), jnp.int32)
    layer = jax.ShapeDtypeStruct((1,), jnp.int32)

    def f(x, w, ids, sizes, layer):
        return grouped_matmul(x, w, sizes, w_up=w, row_ids=ids, layer=layer)

    text = jax.jit(f).trace(x, w, ids, sizes, layer).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count(f"custom_call @{_triton_custom_call_target()}") == 1
    assert 'name = "grouped_swiglu"' in text and "interpret" not in text.lower()
