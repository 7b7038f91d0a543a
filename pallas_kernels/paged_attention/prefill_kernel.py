"""Pallas (Triton backend) paged attention for prefill chunks and verify windows.

Owns the GPU path for T > 1 query tokens per row: row `b`'s chunk attends to the row's cached
pages (positions `< cached_lens[b]`) and causally to its own keys (`chunk_k/chunk_v`, key `j`
visible to query `i` when `j <= i < chunk_lens[b]`). It reads the same `PagedAttentionInputs`
and gives the result of `reference.paged_attention_prefill_reference`, which is its oracle; it
does not write pages. On CPU it runs only with `interpret=True`.

Shape of the computation. Queries are laid out `[B, H_kv, T * G, D]`: the `G = H_q // H_kv`
query heads sharing a kv head become rows `t * G + g` (g fastest), so a block of `block_m` rows
covers consecutive tokens and every row of the block shares its kv head. The grid is
`(B, H_kv, cdiv(T * G, block_m))`. A program runs two online-softmax loops (running max, running
sum, fp32 accumulator) into one accumulator:
  1. over the row's cached pages, `block_k` positions per step gathered in the kernel through
     the page table (`kernel.load_block`, `load_keys`; scalar prefetch being TPU-only), `cdiv(cached_lens[b],
     block_k)` steps (with `skip_empty`, keys whose logit is exactly zero masked);
  2. over the chunk's keys, `block_c` per step, up to the block's last token (keys above the
     causal diagonal of every row of the block are never read).
Masked logits never reach the sums (`where` on the probabilities), masked values are zeroed
(stale pages and padding may hold NaN), and rows at or past `chunk_lens[b]` are written as
zeros.
INT8 pages come with their scales and are dequantized tile by tile as they are loaded
(`kernel.load_keys`); the chunk's own K/V are floats (in q's dtype). `block_k` (cached keys per
step) is the largest power of two up to `TARGET_BLOCK_K` whose tiles fit the target GPU's
shared memory (`prefill_shared_bytes`, measured by ptxas on sm_90).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention.inputs import PagedAttentionInputs
from pallas_kernels.paged_attention.kernel import (
    _PRECISION,
    MIN_BLOCK_H,
    MIN_BLOCK_K,
    _is_pow2,
    fitting_block_k,
    load_block,
    skipping,
)
from pallas_kernels.paged_attention.reference import default_scale
from pallas_kernels.target import gpu_limits

TARGET_BLOCK_K = 64  # cached key positions per loop step when the target's memory allows
DEFAULT_BLOCK_M = 32  # query rows (token x head-in-group) per program
DEFAULT_BLOCK_C = 32  # chunk keys per loop step


def prefill_shared_bytes(block_k: int, block_c: int, block_m: int, head_dim: int,
                         itemsize: int) -> int:
    """Shared memory Triton gives the prefill kernel (ptxas's figure on sm_90 for fp32 and
    bf16, head_dim 128..256: two stages of the K and V tiles of the larger key loop, and the
    query tile)."""
    return (4 * max(block_k, block_c) + block_m) * head_dim * itemsize


def _online_update(carry, q, k, v, mask, scale, skip_empty: bool = False):
    """One online-softmax step of `q [M, D]` over `k, v [N, D]` where `mask [M, N]`
    (`skip_empty`: and where the logit is not exactly zero, `kernel.skipping`)."""
    acc, row_max, row_sum = carry
    logits = plgpu.dot(q, k, trans_b=True, precision=_PRECISION) * scale  # [M, N]
    mask = skipping(mask, logits, skip_empty)
    logits = jnp.where(mask, logits, -jnp.inf)
    new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
    correction = jnp.exp(row_max - new_max)
    probs = jnp.where(mask, jnp.exp(logits - new_max[:, None]), 0.0)
    acc = acc * correction[:, None] + plgpu.dot(probs.astype(v.dtype), v, precision=_PRECISION)
    return acc, new_max, row_sum * correction + jnp.sum(probs, axis=1)


def _prefill_kernel(
    prior_ref,  # [1] int32 cached positions of this row
    chunk_len_ref,  # [1] int32 valid chunk tokens of this row
    page_ids_ref,  # [padded_pages] int32, the row's page table
    q_ref,  # [block_m, D]
    k_pages_ref,  # [P, page_size, D] (this program's kv head)
    v_pages_ref,  # [P, page_size, D]
    chunk_k_ref,  # [T_pad, D]
    chunk_v_ref,  # [T_pad, D]
    *refs,  # int8 pages: k_scales_ref, v_scales_ref [P, page_size]; then o_ref [block_m, D]
    scale: float,
    group: int,
    block_k: int,
    block_c: int,
    num_pages: int,
    skip_empty: bool,
):
    *scale_refs, o_ref = refs
    k_scales_ref, v_scales_ref = scale_refs or (None, None)
    block_m, head_dim = q_ref.shape
    prior_len, chunk_len = prior_ref[0], chunk_len_ref[0]
    first_row = pl.program_id(2) * block_m
    rows = first_row + lax.broadcasted_iota(jnp.int32, (block_m, 1), 0)
    tokens = rows // group  # [block_m, 1] the chunk token of each row
    q = q_ref[...]
    # Finite start: a row whose first block is all masked keeps exp(-inf - start) = 0.
    init = (jnp.zeros((block_m, head_dim), jnp.float32),
            jnp.full((block_m,), jnp.finfo(jnp.float32).min, jnp.float32),
            jnp.zeros((block_m,), jnp.float32))

    def cached(step, carry):
        start = step * block_k
        k, v, valid = load_block((k_pages_ref, v_pages_ref), (k_scales_ref, v_scales_ref),
                                 page_ids_ref, start, block_k, num_pages, prior_len, q.dtype)
        v = jnp.where(valid.reshape(block_k, 1), v, jnp.zeros_like(v))
        mask = jnp.broadcast_to(valid, (block_m, block_k))
        return _online_update(carry, q, k, v, mask, scale, skip_empty)

    def own(step, carry):
        k = chunk_k_ref[pl.ds(step * block_c, block_c), :]
        v = chunk_v_ref[pl.ds(step * block_c, block_c), :]
        keys = step * block_c + lax.broadcasted_iota(jnp.int32, (1, block_c), 1)
        real = keys < chunk_len  # [1, block_c]
        v = jnp.where(real.reshape(block_c, 1), v, jnp.zeros_like(v))
        mask = real & (keys <= tokens)  # [block_m, block_c]
        return _online_update(carry, q, k, v, mask, scale)

    carry = lax.fori_loop(0, (prior_len + block_k - 1) // block_k, cached, init)
    last_token = (first_row + block_m - 1) // group
    visible = jnp.minimum(chunk_len, last_token + 1)
    acc, _, row_sum = lax.fori_loop(0, (visible + block_c - 1) // block_c, own, carry)
    row_sum = jnp.where(row_sum == 0.0, 1.0, row_sum)
    out = jnp.where(tokens < chunk_len, acc / row_sum[:, None], 0.0)
    o_ref[...] = out.astype(o_ref.dtype)


def paged_attention_prefill_pallas(
    q: jax.Array,
    inputs: PagedAttentionInputs,
    *,
    scale: float | None = None,
    block_k: int | None = None,
    block_m: int = DEFAULT_BLOCK_M,
    block_c: int = DEFAULT_BLOCK_C,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Prefill attention of B rows' chunks over their pages and themselves, with a Pallas kernel.

    Args:
      q: `[B, T, H_q, D]` chunk queries, not pre-scaled; `D` a power of two.
      inputs: the pages (`page_size` a power of two) and the chunks; rows at or past a row's
        `chunk_lens` give zeros. Int8 pages are dequantized to q's dtype as they are loaded,
        and the chunk's own K/V are then taken in q's dtype.
      scale: logit scale, default `D**-0.5`.
      block_k: cached key positions per loop step, a power of two >= 16 (whole pages or part
        of one); default: the largest up to `TARGET_BLOCK_K` that fits the target's shared
        memory (`prefill_shared_bytes`).
      block_m: query rows per program, a power of two >= 16 (Triton's smallest dot).
      block_c: chunk keys per loop step, a power of two >= 16.
      num_warps, num_stages: Triton launch parameters (ignored in interpret mode).
      interpret: run the Pallas interpreter (required on CPU).

    Returns:
      `[B, T, H_q, D]` in q's dtype; softmax and accumulation in float32.
    """
    dims = inputs.check_prefill(q)
    batch, num_tokens, num_q_heads, head_dim = q.shape
    max_pages = inputs.page_tables.shape[1]
    if not _is_pow2(head_dim):
        raise ValueError(f"q head_dim must be a power of two for the kernel, got {head_dim}")
    if not _is_pow2(dims.page_size):
        raise ValueError(
            f"k_pages page_size must be a power of two for the kernel, got {dims.page_size}")
    if block_k is None:
        limits = gpu_limits()
        block_k = fitting_block_k(
            TARGET_BLOCK_K, max_pages * dims.page_size,
            lambda bk: limits.fits(prefill_shared_bytes(bk, block_c, block_m, head_dim,
                                                        q.dtype.itemsize)))
    for name, value, low in (("block_k", block_k, MIN_BLOCK_K),
                             ("block_m", block_m, MIN_BLOCK_H), ("block_c", block_c, MIN_BLOCK_H)):
        if not _is_pow2(value) or value < low:
            raise ValueError(f"{name} must be a power of two >= {low}, got {value}")

    group = num_q_heads // dims.num_kv_heads
    num_rows = num_tokens * group
    rows_pad = pl.cdiv(num_rows, block_m) * block_m
    tokens_pad = pl.cdiv(num_tokens, block_c) * block_c
    q_rows = q.reshape(batch, num_tokens, dims.num_kv_heads, group, head_dim)
    q_rows = q_rows.transpose(0, 2, 1, 3, 4).reshape(batch, dims.num_kv_heads, num_rows, head_dim)
    q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, rows_pad - num_rows), (0, 0)))

    scales = () if inputs.k_scales is None else (inputs.k_scales, inputs.v_scales)
    chunk_dtype = q.dtype if scales else inputs.k_pages.dtype  # what the loaded tiles are in

    def heads_first(x):  # [B, T, H_kv, D] -> [B, H_kv, T_pad, D]
        x = x.astype(chunk_dtype).transpose(0, 2, 1, 3)
        return jnp.pad(x, ((0, 0), (0, 0), (0, tokens_pad - num_tokens), (0, 0)))

    pages_per_block = max(1, block_k // dims.page_size)
    padded_pages = pl.cdiv(max_pages, pages_per_block) * pages_per_block
    page_tables = jnp.pad(inputs.page_tables, ((0, 0), (0, padded_pages - max_pages)))

    kernel = functools.partial(
        _prefill_kernel, scale=default_scale(head_dim, scale), group=group,
        block_k=block_k, block_c=block_c, num_pages=dims.num_pages,
        skip_empty=inputs.skip_empty)
    per_row = pl.BlockSpec((None, 1), lambda b, h, m: (b, 0))
    pool = pl.BlockSpec((dims.num_pages, dims.page_size, None, head_dim),
                        lambda b, h, m: (0, 0, h, 0))
    rows = pl.BlockSpec((None, None, block_m, head_dim), lambda b, h, m: (b, h, m, 0))
    chunk = pl.BlockSpec((None, None, tokens_pad, head_dim), lambda b, h, m: (b, h, 0, 0))
    scale_spec = pl.BlockSpec((dims.num_pages, dims.page_size, None), lambda b, h, m: (0, 0, h))
    out = pl.pallas_call(
        kernel,
        grid=(batch, dims.num_kv_heads, rows_pad // block_m),
        in_specs=[per_row, per_row, pl.BlockSpec((None, padded_pages), lambda b, h, m: (b, 0)),
                  rows, pool, pool, chunk, chunk, *(scale_spec for _ in scales)],
        out_specs=rows,
        out_shape=jax.ShapeDtypeStruct(q_rows.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_attention_prefill",
    )(inputs.cached_lens.reshape(batch, 1), inputs.chunk_lens.reshape(batch, 1), page_tables,
      q_rows, inputs.k_pages, inputs.v_pages, heads_first(inputs.chunk_k),
      heads_first(inputs.chunk_v), *scales)
    out = out[:, :, :num_rows].reshape(batch, dims.num_kv_heads, num_tokens, group, head_dim)
    return out.transpose(0, 2, 1, 3, 4).reshape(batch, num_tokens, num_q_heads, head_dim)
