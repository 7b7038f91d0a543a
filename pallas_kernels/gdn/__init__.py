"""Gated DeltaNet's recurrence as Pallas (Triton) kernels, fp32 state `[B, H, dk, dv]`.

`gated_delta_rule` is the entry point a GDN layer calls with `impl="pallas"`: the token-by-token
kernel (`recurrent.py`) for decode and verify windows (T = 1, or the state after every token),
the chunked kernel (`chunked.py`) for prefill. Their oracles are the jnp forms in
`ninfer_jax.models.qwen3_6.gdn` (`recurrent_delta_rule`, `chunked_delta_rule`).
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.gdn.chunked import gated_delta_chunked
from pallas_kernels.gdn.recurrent import gated_delta_recurrent, pow2
from pallas_kernels.platform import by_platform

__all__ = ["gated_delta_chunked", "gated_delta_recurrent", "gated_delta_rule"]


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     state: jax.Array, *, chunk_size: int, keep_states: bool = False,
                     interpret: bool | None = None) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over T tokens per row (shapes as in `gated_delta_recurrent`):
    (out `[B, T, H, dv]`, the final state, or with `keep_states` the state after every token).
    `chunk_size`: the chunked kernel's sub-chunk, rounded up to a power of two >= 16 (the result
    does not depend on it beyond rounding). `interpret`: None decides by the lowering platform
    (the interpreter on CPU)."""
    if q.shape[1] == 1 or keep_states:
        run = functools.partial(gated_delta_recurrent, keep_states=keep_states)
    else:
        chunk = max(16, pow2(chunk_size))
        run = functools.partial(gated_delta_chunked, chunk_size=chunk)
    return by_platform(run, interpret, q, k, v, g, beta, state)
