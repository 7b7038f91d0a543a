"""Paged attention over one attention layer's page pool `[P, page_size, H_kv, D]`.

`paged_attention_decode` (one query token per row) and `paged_attention_prefill` (a chunk or a
verify window per row, over the row's cached pages plus the chunk itself) are the entry points
the Program calls; each picks the pure-jnp reference (the CPU default) or its Pallas kernel.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax

from pallas_kernels.paged_attention.kernel import paged_attention
from pallas_kernels.paged_attention.prefill_kernel import paged_prefill_attention
from pallas_kernels.paged_attention.reference import (
    paged_attention_reference,
    paged_prefill_attention_reference,
)
from pallas_kernels.paged_attention.shapes import check_prefill_batch
from pallas_kernels.platform import by_platform

AttentionImpl = Literal["reference", "pallas"]
ATTENTION_IMPLS: tuple[AttentionImpl, ...] = ("reference", "pallas")

__all__ = [
    "ATTENTION_IMPLS",
    "AttentionImpl",
    "paged_attention",
    "paged_attention_decode",
    "paged_attention_prefill",
    "paged_attention_reference",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
]


def paged_attention_decode(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    lengths: jax.Array,
    *,
    scale: float | None = None,
    impl: AttentionImpl = "reference",
    interpret: bool | None = None,
    pages_per_block: int | None = None,
) -> jax.Array:
    """Decode attention: q `[B, H_q, D]` over pages `[P, page_size, H_kv, D]` -> `[B, H_q, D]`.

    Args:
      q, k_pages, v_pages, page_tables, lengths, scale: as in `paged_attention_reference`.
      impl: "reference" (pure jnp) or "pallas" (the Triton-style kernel).
      interpret: for impl="pallas" only; None (the default) decides by the platform the step
        is lowered for (`jax.lax.platform_dependent`): the interpreter on CPU, where the kernel
        cannot run compiled, the compiled kernel elsewhere; so a CPU host lowering for CUDA gets
        the real kernel.
      pages_per_block: for impl="pallas" only; see `paged_attention`.
    """
    if impl == "reference":
        return paged_attention_reference(q, k_pages, v_pages, page_tables, lengths, scale=scale)
    if impl == "pallas":
        run = functools.partial(paged_attention, scale=scale, pages_per_block=pages_per_block)
        return by_platform(run, interpret, q, k_pages, v_pages, page_tables, lengths)
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
    *,
    scale: float | None = None,
    impl: AttentionImpl = "reference",
    interpret: bool | None = None,
) -> jax.Array:
    """Prefill attention of B rows: q `[B, T, H_q, D]` over each row's cached pages and its own
    chunk keys `[B, T, H_kv, D]` -> `[B, T, H_q, D]`.

    Args:
      q, k_pages, v_pages, scale: as in `paged_prefill_attention_reference`, with a leading B.
      page_tables: `[B, max_pages_per_seq]` int32; prior_lens, chunk_lens: `[B]` int32.
      chunk_k, chunk_v: `[B, T, H_kv, D]`.
      impl: "reference" (the jnp reference per row) or "pallas" (`paged_prefill_attention`).
      interpret: as in `paged_attention_decode`.
    """
    args = (q, k_pages, v_pages, page_tables, prior_lens, chunk_k, chunk_v, chunk_lens)
    if impl == "reference":
        check_prefill_batch(*args)
        per_row = functools.partial(paged_prefill_attention_reference, scale=scale)
        return jax.vmap(per_row, in_axes=(0, None, None, 0, 0, 0, 0, 0))(*args)
    if impl == "pallas":
        return by_platform(functools.partial(paged_prefill_attention, scale=scale), interpret,
                           *args)
    raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")

