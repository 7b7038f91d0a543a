"""Paged attention over one attention layer's page pool `[P, page_size, H_kv, D]`.

`paged_attention_decode` (one query token per row) and `paged_attention_prefill` (a chunk or a
verify window per row, over the row's cached pages plus the chunk itself) are the entry points
the Program calls; each picks the pure-jnp reference (the CPU default) or its Pallas kernel,
named after it: `paged_attention_decode_reference` / `paged_attention_decode_pallas`, and
`paged_attention_prefill_reference` / `paged_attention_prefill_pallas`.
Pools are float, or INT8 with per-token, per-head scales (`quant.py`: `quantize`, `dequantize`).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax

from pallas_kernels.paged_attention.kernel import paged_attention_decode_pallas
from pallas_kernels.paged_attention.prefill_kernel import paged_attention_prefill_pallas
from pallas_kernels.paged_attention.quant import dequantize, quantize
from pallas_kernels.paged_attention.reference import (
    paged_attention_decode_reference,
    paged_attention_prefill_reference,
)
from pallas_kernels.paged_attention.shapes import check_prefill_batch
from pallas_kernels.platform import by_platform

AttentionImpl = Literal["reference", "pallas"]
ATTENTION_IMPLS: tuple[AttentionImpl, ...] = ("reference", "pallas")

__all__ = [
    "ATTENTION_IMPLS",
    "AttentionImpl",
    "dequantize",
    "paged_attention_decode",
    "paged_attention_decode_pallas",
    "paged_attention_decode_reference",
    "paged_attention_prefill",
    "paged_attention_prefill_pallas",
    "paged_attention_prefill_reference",
    "quantize",
]


def paged_attention_decode(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    lengths: jax.Array,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    *,
    scale: float | None = None,
    impl: AttentionImpl = "reference",
    interpret: bool | None = None,
    block_k: int | None = None,
) -> jax.Array:
    """Decode attention: q `[B, H_q, D]` over pages `[P, page_size, H_kv, D]` -> `[B, H_q, D]`.

    Args:
      q, k_pages, v_pages, page_tables, lengths, k_scales, v_scales, scale: as in
        `paged_attention_decode_reference` (the scales: of int8 pages only).
      impl: "reference" (pure jnp) or "pallas" (the Triton-style kernel).
      interpret: for impl="pallas" only; None (the default) decides by the platform the step
        is lowered for (`jax.lax.platform_dependent`): the interpreter on CPU, where the kernel
        cannot run compiled, the compiled kernel elsewhere; so a CPU host lowering for CUDA gets
        the real kernel.
      block_k: for impl="pallas" only; see `paged_attention_decode_pallas`.
    """
    scales = () if k_scales is None and v_scales is None else (k_scales, v_scales)
    args = (q, k_pages, v_pages, page_tables, lengths, *scales)
    if impl == "reference":
        return paged_attention_decode_reference(*args, scale=scale)
    if impl == "pallas":
        run = functools.partial(paged_attention_decode_pallas, scale=scale, block_k=block_k)
        return by_platform(run, interpret, *args)
    raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")


def paged_attention_prefill(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    prior_lens: jax.Array,
    chunk_k: jax.Array,
    chunk_v: jax.Array,
    chunk_lens: jax.Array,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    *,
    scale: float | None = None,
    impl: AttentionImpl = "reference",
    interpret: bool | None = None,
) -> jax.Array:
    """Prefill attention of B rows: q `[B, T, H_q, D]` over each row's cached pages and its own
    chunk keys `[B, T, H_kv, D]` -> `[B, T, H_q, D]`.

    Args:
      q, k_pages, v_pages, scale: as in `paged_attention_prefill_reference`, with a leading B.
      page_tables: `[B, max_pages_per_seq]` int32; prior_lens, chunk_lens: `[B]` int32.
      chunk_k, chunk_v: `[B, T, H_kv, D]`.
      k_scales, v_scales: `[P, page_size, H_kv]` the scales of int8 pages (None for float
        pages); the chunk's own K/V are floats (a writer of int8 pages passes their
        dequantized values).
      impl: "reference" (the jnp reference per row) or "pallas" (`paged_attention_prefill_pallas`).
      interpret: as in `paged_attention_decode`.
    """
    scales = () if k_scales is None and v_scales is None else (k_scales, v_scales)
    args = (q, k_pages, v_pages, page_tables, prior_lens, chunk_k, chunk_v, chunk_lens, *scales)
    if impl == "reference":
        check_prefill_batch(*args)
        per_row = functools.partial(paged_attention_prefill_reference, scale=scale)
        in_axes = (0, None, None, 0, 0, 0, 0, 0) + (None,) * len(scales)
        return jax.vmap(per_row, in_axes=in_axes)(*args)
    if impl == "pallas":
        return by_platform(functools.partial(paged_attention_prefill_pallas, scale=scale),
                           interpret, *args)
    raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")

