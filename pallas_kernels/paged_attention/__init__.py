"""Paged attention over one attention layer's page pool `[P, page_size, H_kv, D]`.

`paged_attention_decode` is the one entry point the Program calls for decode; it picks the
pure-jnp reference (the CPU default) or the Pallas kernel. Prefill attention over cached pages
plus the current chunk has only the jnp reference, `paged_prefill_attention_reference`.
"""

from __future__ import annotations

import functools
from typing import Literal

import jax

from pallas_kernels.paged_attention.kernel import paged_attention
from pallas_kernels.paged_attention.reference import (
    paged_attention_reference,
    paged_prefill_attention_reference,
)

AttentionImpl = Literal["reference", "pallas"]
ATTENTION_IMPLS: tuple[AttentionImpl, ...] = ("reference", "pallas")

__all__ = [
    "ATTENTION_IMPLS",
    "AttentionImpl",
    "paged_attention",
    "paged_attention_decode",
    "paged_attention_reference",
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
        args = (q, k_pages, v_pages, page_tables, lengths)
        if interpret is not None:
            return run(*args, interpret=interpret)
        return jax.lax.platform_dependent(*args, cpu=functools.partial(run, interpret=True),
                                          default=functools.partial(run, interpret=False))
    raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
