"""Pure-jnp paged attention: the CPU default path and the oracle for the Pallas kernel.

Owns decode attention over a page pool (many rows, one query token each) and prefill attention
of each row's chunk over its cached pages plus the chunk itself, both reading
`PagedAttentionInputs` (`inputs.py`, which checks them). Does not write pages and does not apply
RoPE, norms or output gates; callers do.

Layout (DESIGN §10): one attention layer's pool is `k_pages, v_pages: [P, page_size, H_kv, D]`.
Query head `h` reads kv head `h // (H_q // H_kv)` (GQA). Logits are `scale * q·k` with
`scale = D**-0.5` unless given; softmax and accumulation run in float32 and the result is cast to
q's dtype. Key positions at or beyond a row's length are masked and their K/V contents, whatever
they are (stale data, NaN), never reach the output. With `inputs.skip_empty` a cached
position whose logit is exactly zero is masked for that query (`PagedAttentionInputs.
skip_empty`). INT8 pools (`quant.py`) come with `k_scales, v_scales: [P, page_size,
H_kv]`; each gathered page is dequantized to q's dtype (the compute dtype, as the kernels
do: `quant.dequantize`), then used as float pages are.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention.inputs import PagedAttentionInputs, PoolDims
from pallas_kernels.paged_attention.quant import dequantize

_HIGHEST = lax.Precision.HIGHEST


def default_scale(head_dim: int, scale: float | None) -> float:
    """Returns `scale`, or `head_dim**-0.5` when it is None."""
    return head_dim**-0.5 if scale is None else float(scale)


def _gather_rows(pages: jax.Array, page_ids: jax.Array, dims: PoolDims,
                 scales: jax.Array | None = None, dtype=jnp.float32) -> jax.Array:
    """Gathers `[..., max_pages]` page ids into `[..., max_pages * page_size, H_kv, D]` fp32
    (int8 pages dequantized to `dtype` with their `scales`)."""
    page_ids = jnp.clip(page_ids, 0, dims.num_pages - 1)
    gathered = pages[page_ids]
    if scales is not None:
        gathered = dequantize(gathered, scales[page_ids], dtype)
    gathered = gathered.astype(jnp.float32)
    lead = page_ids.shape[:-1]
    return gathered.reshape(
        *lead, page_ids.shape[-1] * dims.page_size, dims.num_kv_heads, dims.head_dim
    )


def _skipping(mask: jax.Array, logits: jax.Array, cached: jax.Array | None,
              skip_empty: bool) -> jax.Array:
    """mask, and with `skip_empty` not where a cached key's logit is exactly zero (`cached`:
    which keys of the last axis are cached, None: all)."""
    if not skip_empty:
        return mask
    empty = logits == 0
    return mask & ~(empty if cached is None else empty & cached)


def _masked_softmax_weights(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis restricted to `mask`; rows with no valid key give all zeros."""
    logits = jnp.where(mask, logits, -jnp.inf)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.where(mask, jnp.exp(logits - row_max), 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    return weights / jnp.where(denom == 0.0, 1.0, denom)


def paged_attention_decode_reference(
    q: jax.Array, inputs: PagedAttentionInputs, *, scale: float | None = None
) -> jax.Array:
    """Decode attention of one query token per row over that row's pages.

    Args:
      q: `[B, H_q, D]` queries, not pre-scaled.
      inputs: the pages, with no chunk. Row `b` attends to its first `cached_lens[b]`
        positions (0 gives a zero output row); page table entries past a row's last page may
        hold any value (out-of-range ids are clamped, their keys masked).
      scale: logit scale, default `D**-0.5`.

    Returns:
      `[B, H_q, D]` in q's dtype.
    """
    dims = inputs.check_decode(q)
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // dims.num_kv_heads
    # [B, L, H_kv, D]
    keys = _gather_rows(inputs.k_pages, inputs.page_tables, dims, inputs.k_scales, q.dtype)
    values = _gather_rows(inputs.v_pages, inputs.page_tables, dims, inputs.v_scales, q.dtype)
    valid = jnp.arange(keys.shape[1])[None, :] < inputs.cached_lens[:, None]  # [B, L]
    values = jnp.where(valid[:, :, None, None], values, 0.0)

    qg = q.astype(jnp.float32).reshape(batch, dims.num_kv_heads, group, head_dim)
    logits = jnp.einsum("bhgd,blhd->bhgl", qg, keys, precision=_HIGHEST)
    logits = logits * default_scale(head_dim, scale)
    mask = _skipping(valid[:, None, None, :], logits, None, inputs.skip_empty)
    weights = _masked_softmax_weights(logits, mask)
    out = jnp.einsum("bhgl,blhd->bhgd", weights, values, precision=_HIGHEST)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)


def paged_attention_prefill_reference(
    q: jax.Array, inputs: PagedAttentionInputs, *, scale: float | None = None
) -> jax.Array:
    """Causal attention of each row's prefill chunk over its cached pages and itself.

    Query `i` of row `b` sits at absolute position `cached_lens[b] + i`. It attends to the
    `cached_lens[b]` positions read from the row's pages and to chunk keys `j <= i` with
    `j < chunk_lens[b]` (with `skip_empty`, not a cached key whose logit is exactly zero).
    The chunk's own K/V come from `chunk_k/chunk_v`, so the pages need not
    hold them yet (and page contents at positions `>= cached_lens[b]` are ignored). With int8
    pages the chunk's own K/V are floats all the same; a writer of int8 pages passes their
    dequantized values (in q's dtype), so the chunk sees what its pages will hold.

    Args:
      q: `[B, T, H_q, D]` chunk queries, not pre-scaled; rows `>= chunk_lens[b]` are padding.
      inputs: the pages and the chunks (`chunk_k`, `chunk_v`, `chunk_lens`).
      scale: logit scale, default `D**-0.5`.

    Returns:
      `[B, T, H_q, D]` in q's dtype. Padding rows (`i >= chunk_lens[b]`) are exactly zero, as is
      any row with no valid key.
    """
    dims = inputs.check_prefill(q)
    _, num_tokens, num_q_heads, head_dim = q.shape
    group = num_q_heads // dims.num_kv_heads

    def one_row(q, page_table, prior_len, chunk_k, chunk_v, chunk_len):
        """q `[T, H_q, D]`, page_table `[max_pages_per_seq]`, chunk_k/v `[T, H_kv, D]`, lengths
        scalars -> `[T, H_q, D]`."""
        cached_k = _gather_rows(inputs.k_pages, page_table, dims, inputs.k_scales, q.dtype)
        cached_v = _gather_rows(inputs.v_pages, page_table, dims, inputs.v_scales, q.dtype)
        keys = jnp.concatenate([cached_k, chunk_k.astype(jnp.float32)], axis=0)  # [L + T, ...]
        values = jnp.concatenate([cached_v, chunk_v.astype(jnp.float32)], axis=0)

        num_cached = cached_k.shape[0]
        rows = jnp.arange(num_tokens)
        cached_valid = jnp.broadcast_to(
            jnp.arange(num_cached)[None, :] < prior_len, (num_tokens, num_cached)
        )
        chunk_valid = (rows[None, :] <= rows[:, None]) & (rows[None, :] < chunk_len)
        valid = jnp.concatenate([cached_valid, chunk_valid], axis=1)  # [T, L + T]
        valid = valid & (rows < chunk_len)[:, None]
        key_used = jnp.any(valid, axis=0)  # [L + T]
        values = jnp.where(key_used[:, None, None], values, 0.0)

        qg = q.astype(jnp.float32).reshape(num_tokens, dims.num_kv_heads, group, head_dim)
        logits = jnp.einsum("thgd,shd->hgts", qg, keys, precision=_HIGHEST)
        logits = logits * default_scale(head_dim, scale)
        cached = jnp.arange(num_cached + num_tokens) < num_cached
        mask = _skipping(valid[None, None, :, :], logits, cached, inputs.skip_empty)
        weights = _masked_softmax_weights(logits, mask)
        out = jnp.einsum("hgts,shd->thgd", weights, values, precision=_HIGHEST)
        return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)

    return jax.vmap(one_row)(q, inputs.page_tables, inputs.cached_lens, inputs.chunk_k,
                             inputs.chunk_v, inputs.chunk_lens)
