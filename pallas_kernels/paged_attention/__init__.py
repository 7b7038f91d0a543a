"""Paged attention over one attention layer's page pool `[P, page_size, H_kv, D]`.

`paged_attention_decode` (one query token per row) and `paged_attention_prefill` (a chunk or a
verify window per row, over the row's cached pages plus the chunk itself) are the entry points
the Program calls; each picks the pure-jnp reference (the CPU default) or its Pallas kernel,
named after it: `paged_attention_decode_reference` / `paged_attention_decode_pallas`, and
`paged_attention_prefill_reference` / `paged_attention_prefill_pallas`. All six take the
queries and one `PagedAttentionInputs` (`inputs.py`: the pages, page tables and cached lengths,
the scales of INT8 pages, and prefill's chunk), whose methods check the shapes.
Pools are float, or INT8 with per-token, per-head scales (`quant.py`: `quantize`, `dequantize`).
"""

from __future__ import annotations

import functools
from typing import Literal

import jax

from pallas_kernels.paged_attention.inputs import PagedAttentionInputs
from pallas_kernels.paged_attention.kernel import paged_attention_decode_pallas
from pallas_kernels.paged_attention.prefill_kernel import paged_attention_prefill_pallas
from pallas_kernels.paged_attention.quant import dequantize, quantize
from pallas_kernels.paged_attention.reference import (
    paged_attention_decode_reference,
    paged_attention_prefill_reference,
)
from pallas_kernels.platform import by_platform

AttentionImpl = Literal["reference", "pallas"]
ATTENTION_IMPLS: tuple[AttentionImpl, ...] = ("reference", "pallas")

__all__ = [
    "ATTENTION_IMPLS",
    "AttentionImpl",
    "PagedAttentionInputs",
    "dequantize",
    "paged_attention_decode",
    "paged_attention_decode_pallas",
    "paged_attention_decode_reference",
    "paged_attention_prefill",
    "paged_attention_prefill_pallas",
    "paged_attention_prefill_reference",
    "quantize",
]


def paged_attention_decode(q: jax.Array, inputs: PagedAttentionInputs, *,
                           scale: float | None = None, impl: AttentionImpl = "reference",
                           interpret: bool | None = None, block_k: int | None = None
                           ) -> jax.Array:
    """Decode attention: q `[B, H_q, D]` over pages `[P, page_size, H_kv, D]` -> `[B, H_q, D]`.

    Args:
      q, inputs, scale: as in `paged_attention_decode_reference` (inputs without a chunk).
      impl: "reference" (pure jnp) or "pallas" (the Triton-style kernel).
      interpret: for impl="pallas" only; None (the default) decides by the platform the step
        is lowered for (`jax.lax.platform_dependent`): the interpreter on CPU, where the kernel
        cannot run compiled, the compiled kernel elsewhere; so a CPU host lowering for CUDA gets
        the real kernel.
      block_k: for impl="pallas" only; see `paged_attention_decode_pallas`.
    """
    if impl == "reference":
        return paged_attention_decode_reference(q, inputs, scale=scale)
    if impl == "pallas":
        run = functools.partial(paged_attention_decode_pallas, scale=scale, block_k=block_k)
        return by_platform(run, interpret, q, inputs)
    raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")


def paged_attention_prefill(q: jax.Array, inputs: PagedAttentionInputs, *,
                            scale: float | None = None, impl: AttentionImpl = "reference",
                            interpret: bool | None = None) -> jax.Array:
    """Prefill attention of B rows: q `[B, T, H_q, D]` over each row's cached pages and its own
    chunk keys `[B, T, H_kv, D]` -> `[B, T, H_q, D]`.

    Args:
      q, inputs, scale: as in `paged_attention_prefill_reference` (inputs with the chunks; the
        chunks' own K/V are floats, a writer of int8 pages passing their dequantized values).
      impl: "reference" (pure jnp) or "pallas" (`paged_attention_prefill_pallas`).
      interpret: as in `paged_attention_decode`.
    """
    if impl == "reference":
        return paged_attention_prefill_reference(q, inputs, scale=scale)
    if impl == "pallas":
        run = functools.partial(paged_attention_prefill_pallas, scale=scale)
        return by_platform(run, interpret, q, inputs)
    raise ValueError(f"impl must be one of {ATTENTION_IMPLS}, got {impl!r}")
