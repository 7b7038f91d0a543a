"""Trace-time argument checks shared by the paged attention reference and kernel.

Owns the shape and dtype contract of the page pool and the decode/prefill inputs; computes
nothing on device. Every check runs in Python on static shapes, so a bad call fails at trace time
with the argument's name and the shape it should have had.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class PoolDims:
    """Static sizes of one attention layer's page pool `[P, page_size, H_kv, D]`."""

    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int


def _shape_str(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def check_pool(k_pages: jax.Array, v_pages: jax.Array) -> PoolDims:
    """Checks `k_pages` and `v_pages` are equal-shaped `[P, page_size, H_kv, D]` pools."""
    _require(
        k_pages.ndim == 4,
        "k_pages must be [num_pages, page_size, num_kv_heads, head_dim], got "
        f"{_shape_str(k_pages.shape)}",
    )
    _require(
        v_pages.shape == k_pages.shape,
        f"v_pages must have k_pages' shape {_shape_str(k_pages.shape)}, got "
        f"{_shape_str(v_pages.shape)}",
    )
    _require(
        v_pages.dtype == k_pages.dtype,
        f"v_pages must have k_pages' dtype {k_pages.dtype}, got {v_pages.dtype}",
    )
    return PoolDims(*k_pages.shape)


def check_scales(
    k_pages: jax.Array, k_scales: jax.Array | None, v_scales: jax.Array | None
) -> None:
    """Checks the INT8 pool's scales (`quant.py`): int8 pages come with `k_scales` and
    `v_scales` `[P, page_size, H_kv]` floats, float pages with neither."""
    if k_scales is None and v_scales is None:
        _require(k_pages.dtype != jnp.int8, "int8 k_pages/v_pages need k_scales and v_scales")
        return
    _require(
        k_pages.dtype == jnp.int8,
        f"k_scales/v_scales are for int8 pages, got k_pages of dtype {k_pages.dtype}",
    )
    for name, x in (("k_scales", k_scales), ("v_scales", v_scales)):
        _require(x is not None, f"int8 pages need both k_scales and v_scales, {name} is None")
        _require(
            x.shape == k_pages.shape[:3] and jnp.issubdtype(x.dtype, jnp.floating),
            f"{name} must be floats of shape [num_pages, page_size, num_kv_heads] = "
            f"{_shape_str(k_pages.shape[:3])}, got {x.dtype} {_shape_str(x.shape)}",
        )


def check_query_heads(name: str, q: jax.Array, dims: PoolDims) -> None:
    """Checks the last two axes of `q` are `[H_q, D]` with `H_q` a multiple of `H_kv`."""
    num_q_heads, head_dim = q.shape[-2:]
    _require(
        head_dim == dims.head_dim,
        f"{name} head_dim must equal the pool's head_dim {dims.head_dim}, got "
        f"{_shape_str(q.shape)}",
    )
    _require(
        num_q_heads % dims.num_kv_heads == 0,
        f"{name} num_q_heads ({num_q_heads}) must be a multiple of the pool's num_kv_heads "
        f"({dims.num_kv_heads})",
    )


def _check_int32(name: str, x: jax.Array) -> None:
    _require(x.dtype == jnp.int32, f"{name} must be int32, got {x.dtype}")


def check_decode_inputs(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_tables: jax.Array,
    lengths: jax.Array,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> PoolDims:
    """Checks decode inputs: q `[B, H_q, D]`, page_tables `[B, max_pages]`, lengths `[B]`, and
    the scales of int8 pages."""
    dims = check_pool(k_pages, v_pages)
    check_scales(k_pages, k_scales, v_scales)
    _require(
        q.ndim == 3,
        f"q must be [B, num_q_heads, head_dim={dims.head_dim}], got {_shape_str(q.shape)}",
    )
    check_query_heads("q", q, dims)
    batch = q.shape[0]
    _require(
        page_tables.ndim == 2 and page_tables.shape[0] == batch,
        f"page_tables must be [B={batch}, max_pages_per_seq], got {_shape_str(page_tables.shape)}",
    )
    _check_int32("page_tables", page_tables)
    _require(
        lengths.shape == (batch,),
        f"lengths must be [B={batch}], got {_shape_str(lengths.shape)}",
    )
    _check_int32("lengths", lengths)
    return dims


def check_prefill_inputs(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    page_table: jax.Array,
    prior_len: jax.Array,
    chunk_k: jax.Array,
    chunk_v: jax.Array,
    chunk_len: jax.Array,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> PoolDims:
    """Checks one sequence's prefill inputs: q `[T, H_q, D]`, chunk_k/v `[T, H_kv, D]`, and the
    scales of int8 pages."""
    dims = check_pool(k_pages, v_pages)
    check_scales(k_pages, k_scales, v_scales)
    _require(
        q.ndim == 3,
        f"q must be [T, num_q_heads, head_dim={dims.head_dim}], got {_shape_str(q.shape)}",
    )
    check_query_heads("q", q, dims)
    chunk_shape = (q.shape[0], dims.num_kv_heads, dims.head_dim)
    for name, x in (("chunk_k", chunk_k), ("chunk_v", chunk_v)):
        _require(
            x.shape == chunk_shape,
            f"{name} must be [T, num_kv_heads, head_dim] = {_shape_str(chunk_shape)}, got "
            f"{_shape_str(x.shape)}",
        )
    _require(
        page_table.ndim == 1,
        f"page_table must be [max_pages_per_seq], got {_shape_str(page_table.shape)}",
    )
    _check_int32("page_table", page_table)
    for name, x in (("prior_len", prior_len), ("chunk_len", chunk_len)):
        _require(jnp.ndim(x) == 0, f"{name} must be a scalar, got {_shape_str(jnp.shape(x))}")
    return dims


def check_prefill_batch(
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
) -> PoolDims:
    """Checks B rows' prefill inputs: q `[B, T, H_q, D]`, chunk_k/v `[B, T, H_kv, D]`,
    page_tables `[B, max_pages]`, prior_lens and chunk_lens `[B]` int32, the scales of int8
    pages."""
    _require(q.ndim == 4, f"q must be [B, T, num_q_heads, head_dim], got {_shape_str(q.shape)}")
    batch = q.shape[0]
    for name, x, ndim in (("chunk_k", chunk_k, 4), ("chunk_v", chunk_v, 4),
                          ("page_tables", page_tables, 2)):
        _require(x.ndim == ndim and x.shape[0] == batch,
                 f"{name} must have {ndim} axes and B={batch} rows, got {_shape_str(x.shape)}")
    for name, x in (("prior_lens", prior_lens), ("chunk_lens", chunk_lens)):
        _require(x.shape == (batch,), f"{name} must be [B={batch}], got {_shape_str(x.shape)}")
        _check_int32(name, x)

    def row(x: jax.Array) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)

    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return check_prefill_inputs(row(q), k_pages, v_pages, row(page_tables), scalar,
                                row(chunk_k), row(chunk_v), scalar, k_scales, v_scales)
