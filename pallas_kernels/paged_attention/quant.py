"""INT8 K/V pages: the one definition of how a key or value vector is stored and read back.

Symmetric, per token and per kv head: a vector `x [D]` is stored as `q = clip(round(x / s),
-127, 127)` (int8, round half to even) with `s = max|x| / 127` (float32), and read back as
`q * s`. A zero vector has `s = 0` and reads back as zeros. The writer (`ninfer_jax.program.
pools.PagedKV`) quantizes; the attention reference and kernels dequantize the pages they load,
page by page, with exactly `dequantize`'s arithmetic (an fp32 product, then the compute dtype).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QMAX = 127  # int8 levels either side of zero (-128 unused: the range is symmetric)
SCALE_DTYPE = jnp.float32


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`x [..., D]` -> (`q [..., D]` int8, `s [...]` float32), per vector over the last axis."""
    x = x.astype(jnp.float32)
    s = jnp.max(jnp.abs(x), axis=-1) / QMAX
    safe = jnp.where(s > 0, s, 1.0)[..., None]
    q = jnp.clip(jnp.round(x / safe), -QMAX, QMAX)
    return q.astype(jnp.int8), s.astype(SCALE_DTYPE)


def dequantize(q: jax.Array, s: jax.Array, dtype=jnp.float32) -> jax.Array:
    """`q [..., D]` int8 with `s [...]` -> `[..., D]` in `dtype` (the product in float32)."""
    return (q.astype(jnp.float32) * s.astype(jnp.float32)[..., None]).astype(dtype)
