"""Pallas (Triton backend) paged attention decode kernel.

Owns the GPU decode path: one query token per row attending over that row's pages. It reads the
same pool layout and gives the same result as `reference.paged_attention_decode_reference`,
which is its oracle; it does not write pages. On CPU it runs only with `interpret=True`.

Shape of the computation. The grid is `(B, H_kv)`: one program per batch row and kv head. The
program holds the `G = H_q // H_kv` query heads that share its kv head, padded to
`block_h = max(16, next_pow2(G))` rows because Triton's dot needs at least 16 rows. Scalar
prefetch is TPU-only, so pages are gathered inside the kernel: each `fori_loop` step reads the
next `block_k` key positions through the row's page table (`load_keys`: whole pages,
`k_ref[page_ids]`, when `block_k >= page_size`, else part of one page) for an online-softmax
update (running max, running sum, fp32 accumulator). The loop runs `cdiv(length, block_k)`
steps, so pages past a row's length are never read and a zero-length row writes zeros. INT8
pages (`quant.py`) come with their scales `[P, page_size, H_kv]`: each loaded tile is multiplied
by its scales inside the loop, so the pool is never dequantized whole.

Block sizes fit the GPU the kernel is built for (`pallas_kernels.target`): `block_k` is the
largest power of two up to `TARGET_BLOCK_K` whose tiles fit its shared memory
(`decode_shared_bytes`, Triton's use measured by ptxas on sm_90), so fp32 and bf16 at head_dim
64..256 and page sizes 16..128 all compile.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.paged_attention.inputs import PagedAttentionInputs
from pallas_kernels.paged_attention.reference import default_scale
from pallas_kernels.target import gpu_limits

MIN_BLOCK_H = 16  # smallest M dimension Triton's tl.dot accepts
MIN_BLOCK_K = 16  # smallest N / K dimension of a Triton dot
TARGET_BLOCK_K = 128  # key positions per loop step when the target's shared memory allows
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# Triton's default for float32 operands is TF32; IEEE keeps fp32 pools on the reference's
# numbers. bf16 operands are unaffected.
_PRECISION = lax.Precision.HIGHEST


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def load_keys(pages_ref, scales_ref, table_ref, start, block_k: int, num_pages: int,
              dtype) -> jax.Array:
    """Key (or value) positions `start .. start + block_k` of one row and kv head, `[block_k, D]`,
    read through the row's page table `table_ref` from the pool `[P, page_size, D]`: whole
    pages when `block_k >= page_size` (`start` a multiple of it), else part of the page holding
    `start`. Table entries past the row's pages may hold any value: they are clamped (the
    positions are masked by the caller). INT8 pages are multiplied by their scales
    (`scales_ref [P, page_size]`, fp32 product: `quant.dequantize`) into `dtype`; float pages
    come as stored."""
    page_size, head_dim = pages_ref.shape[1], pages_ref.shape[2]
    if block_k >= page_size:
        n = block_k // page_size
        ids = jnp.clip(table_ref[pl.ds(start // page_size, n)], 0, num_pages - 1)
        x = pages_ref[ids].reshape(block_k, head_dim)
        s = None if scales_ref is None else scales_ref[ids].reshape(block_k, 1)
    else:
        # lax.div / rem and min / max on these non-negative scalars: jnp's floor division,
        # remainder and clip add selects that Pallas' Triton lowering mistypes as i1
        page = jnp.minimum(jnp.maximum(table_ref[lax.div(start, page_size)], 0), num_pages - 1)
        offset = pl.multiple_of(lax.rem(start, page_size), block_k)
        x = pages_ref[page, pl.ds(offset, block_k), :]
        s = None if scales_ref is None else scales_ref[page, pl.ds(offset, block_k)].reshape(
            block_k, 1)
    if s is None:
        return x
    return (x.astype(jnp.float32) * s.astype(jnp.float32)).astype(dtype)


def load_block(pages_refs, scales_refs, table_ref, start, block_k: int, num_pages: int,
               length, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(keys, values, valid) of positions `start .. start + block_k` of one row and kv head:
    `load_keys` of the K and V pools (`pages_refs`, with their `scales_refs` or Nones) and
    which of the positions a row of `length` cached positions holds, `[1, block_k]` bool."""
    k = load_keys(pages_refs[0], scales_refs[0], table_ref, start, block_k, num_pages, dtype)
    v = load_keys(pages_refs[1], scales_refs[1], table_ref, start, block_k, num_pages, dtype)
    positions = start + lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    return k, v, positions < length


def skipping(mask: jax.Array, logits: jax.Array, skip_empty: bool) -> jax.Array:
    """mask, and with `skip_empty` not where the cached keys' logits are exactly zero
    (`PagedAttentionInputs.skip_empty`)."""
    return mask & (logits != 0) if skip_empty else mask


def decode_shared_bytes(block_k: int, head_dim: int, block_h: int, itemsize: int) -> int:
    """Shared memory Triton gives the decode kernel (ptxas's figure on sm_90 for fp32 and bf16,
    head_dim 64..256, block_k 128..512: two stages of the K tile, one of V, the query tile and
    the [block_h, block_k + 1] fp32 probabilities)."""
    return (3 * block_k * head_dim + block_h * head_dim) * itemsize + \
        block_h * (block_k + 1) * 4


def fitting_block_k(target: int, keys: int, fits) -> int:
    """The largest power of two from `target` down to 16 for which `fits(block_k)`, no larger
    than `keys` (the table's positions) rounded up to a power of two; 16 if none fits."""
    block_k = min(target, pl.next_power_of_2(max(keys, MIN_BLOCK_K)))
    while block_k > MIN_BLOCK_K and not fits(block_k):
        block_k //= 2
    return max(block_k, MIN_BLOCK_K)


def _decode_kernel(
    lengths_ref,  # [1] int32
    page_ids_ref,  # [padded_pages] int32, the row's page table
    q_ref,  # [block_h, D]
    k_pages_ref,  # [P, page_size, D] (this program's kv head)
    v_pages_ref,  # [P, page_size, D]
    *refs,  # int8 pages: k_scales_ref, v_scales_ref [P, page_size]; then o_ref [block_h, D]
    scale: float,
    block_k: int,
    num_pages: int,
    skip_empty: bool,
):
    *scale_refs, o_ref = refs
    k_scales_ref, v_scales_ref = scale_refs or (None, None)
    block_h, head_dim = q_ref.shape
    length = lengths_ref[0]
    q = q_ref[...]

    def body(step, carry):
        acc, row_max, row_sum = carry
        start = step * block_k
        k, v, valid = load_block((k_pages_ref, v_pages_ref), (k_scales_ref, v_scales_ref),
                                 page_ids_ref, start, block_k, num_pages, length, q.dtype)

        logits = plgpu.dot(q, k, trans_b=True, precision=_PRECISION) * scale  # [block_h, block_k]
        logits = jnp.where(skipping(valid, logits, skip_empty), logits, _MASK_VALUE)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
        correction = jnp.exp(row_max - new_max)
        probs = jnp.exp(logits - new_max[:, None])
        # Stale or NaN values at masked positions must not leak through 0 * v.
        v = jnp.where(valid.reshape(block_k, 1), v, jnp.zeros_like(v))
        acc = acc * correction[:, None] + plgpu.dot(probs.astype(v.dtype), v, precision=_PRECISION)
        row_sum = row_sum * correction + jnp.sum(probs, axis=1)
        return acc, new_max, row_sum

    init = (
        jnp.zeros((block_h, head_dim), jnp.float32),
        jnp.full((block_h,), jnp.finfo(jnp.float32).min, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    num_steps = (length + block_k - 1) // block_k
    acc, _, row_sum = lax.fori_loop(0, num_steps, body, init)
    row_sum = jnp.where(row_sum == 0.0, 1.0, row_sum)
    o_ref[...] = (acc / row_sum[:, None]).astype(o_ref.dtype)


def paged_attention_decode_pallas(
    q: jax.Array,
    inputs: PagedAttentionInputs,
    *,
    scale: float | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention over a page pool with a Pallas kernel (same contract as the reference).

    Args:
      q: `[B, H_q, D]` queries, not pre-scaled; `D` a power of two.
      inputs: the pages, with no chunk; `page_size` a power of two. Row `b` attends to its
        first `cached_lens[b]` positions (0 gives a zero output row; `skip_empty`: not those
        whose logit is exactly zero); int8 pages are dequantized to q's dtype as they are
        loaded.
      scale: logit scale, default `D**-0.5`.
      block_k: key positions per loop step, a power of two >= 16 (whole pages, or part of
        one); default: the largest up to `TARGET_BLOCK_K` that fits the target's shared
        memory (`decode_shared_bytes`).
      num_warps, num_stages: Triton launch parameters (ignored in interpret mode).
      interpret: run the Pallas interpreter (required on CPU).

    Returns:
      `[B, H_q, D]` in q's dtype; softmax and accumulation in float32.
    """
    dims = inputs.check_decode(q)
    batch, num_q_heads, head_dim = q.shape
    max_pages = inputs.page_tables.shape[1]
    if not _is_pow2(head_dim):
        raise ValueError(f"q head_dim must be a power of two for the kernel, got {head_dim}")
    if not _is_pow2(dims.page_size):
        raise ValueError(
            f"k_pages page_size must be a power of two for the kernel, got {dims.page_size}"
        )
    group = num_q_heads // dims.num_kv_heads
    block_h = max(MIN_BLOCK_H, pl.next_power_of_2(group))
    if block_k is None:
        limits = gpu_limits()
        block_k = fitting_block_k(
            TARGET_BLOCK_K, max_pages * dims.page_size,
            lambda bk: limits.fits(decode_shared_bytes(bk, head_dim, block_h,
                                                       q.dtype.itemsize)))
    if not _is_pow2(block_k) or block_k < MIN_BLOCK_K:
        raise ValueError(f"block_k must be a power of two >= {MIN_BLOCK_K}, got {block_k}")
    pages_per_block = max(1, block_k // dims.page_size)
    q_blocks = q.reshape(batch, dims.num_kv_heads, group, head_dim)
    q_blocks = jnp.pad(q_blocks, ((0, 0), (0, 0), (0, block_h - group), (0, 0)))
    padded_pages = pl.cdiv(max_pages, pages_per_block) * pages_per_block
    page_tables = jnp.pad(inputs.page_tables, ((0, 0), (0, padded_pages - max_pages)))

    kernel = functools.partial(
        _decode_kernel,
        scale=default_scale(head_dim, scale),
        block_k=block_k,
        num_pages=dims.num_pages,
        skip_empty=inputs.skip_empty,
    )
    pool_spec = pl.BlockSpec(
        (dims.num_pages, dims.page_size, None, head_dim), lambda b, h: (0, 0, h, 0)
    )
    scales = () if inputs.k_scales is None else (inputs.k_scales, inputs.v_scales)
    scale_spec = pl.BlockSpec((dims.num_pages, dims.page_size, None), lambda b, h: (0, 0, h))
    out = pl.pallas_call(
        kernel,
        grid=(batch, dims.num_kv_heads),
        in_specs=[
            pl.BlockSpec((None, 1), lambda b, h: (b, 0)),
            pl.BlockSpec((None, padded_pages), lambda b, h: (b, 0)),
            pl.BlockSpec((None, None, block_h, head_dim), lambda b, h: (b, h, 0, 0)),
            pool_spec,
            pool_spec,
            *(scale_spec for _ in scales),
        ],
        out_specs=pl.BlockSpec((None, None, block_h, head_dim), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct(q_blocks.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_attention_decode",
    )(inputs.cached_lens.reshape(batch, 1), page_tables, q_blocks, inputs.k_pages,
      inputs.v_pages, *scales)
    return out[:, :, :group, :].reshape(batch, num_q_heads, head_dim)
