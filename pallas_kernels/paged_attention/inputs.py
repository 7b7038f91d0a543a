"""What a paged attention call reads besides its queries, and the contract of its shapes.

Owns `PagedAttentionInputs` (one layer's page pool, B rows' page tables and cached lengths, the
scales of INT8 pages, and for prefill each row's chunk) and its trace-time checks; computes
nothing on device. Every check runs in Python on static shapes, so a bad call fails at trace
time with the field's name and the shape it should have had. The reference and the kernels
take the same inputs and check them through the same two methods, `check_decode` and
`check_prefill`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

# The kv-head axis of every field that has one (pages, scales, chunk K/V); the page tables and
# lengths, of at most two axes, have none. A tensor-parallel caller splits heads on it.
HEAD_AXIS = 2


@dataclasses.dataclass(frozen=True)
class PoolDims:
    """Static sizes of one attention layer's page pool `[P, page_size, H_kv, D]`."""

    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k_pages", "v_pages", "page_tables", "cached_lens", "k_scales", "v_scales",
                 "chunk_k", "chunk_v", "chunk_lens"],
    meta_fields=["skip_empty"],
)
@dataclasses.dataclass(frozen=True)
class PagedAttentionInputs:
    """The keys and values B rows of queries attend to: row `b` reads its first
    `cached_lens[b]` positions from the pages (position `t` in page `page_tables[b, t //
    page_size]` at offset `t % page_size`) and, for prefill, its own chunk causally. For
    decode those positions include the query's own token (written to its page first); for
    prefill they are the positions before the chunk.

    Decode leaves the chunk fields None; prefill sets all three. Float pages leave the scales
    None; INT8 pages (`quant.py`) come with both. A None field is an empty pytree, so the
    inputs pass through `jax.jit` and `lax.platform_dependent` either way.

    `skip_empty` (static): a cached position whose logit for a query is exactly zero is
    masked for that query, as a position past the row's length is. An empty entry, which a
    writer leaves on purpose, holds zeros as its key and its value, so every query skips it;
    a written key's logit is exactly zero only by chance (a query then skips that position:
    for the MTP head's attention, the one user, a draft may change, never an output).
    Checking the logit costs nothing; a check of the keys themselves, a second pass over
    them, slowed the CPU reference's decode attention by 20-70% (demo shapes). The
    chunk's own keys are always read.
    """

    k_pages: jax.Array  # [P, page_size, H_kv, D] one layer's page pool: float, or int8 with scales
    v_pages: jax.Array  # [P, page_size, H_kv, D] k_pages' dtype
    page_tables: jax.Array  # [B, max_pages_per_seq] int32; entries past a row's pages: any value
    cached_lens: jax.Array  # [B] int32 positions each row reads from its pages
    k_scales: jax.Array | None = None  # [P, page_size, H_kv] float32 scales of int8 k_pages
    v_scales: jax.Array | None = None  # [P, page_size, H_kv] float32 scales of int8 v_pages
    chunk_k: jax.Array | None = None  # [B, T, H_kv, D] prefill: the chunks' own keys (floats)
    chunk_v: jax.Array | None = None  # [B, T, H_kv, D] prefill: the chunks' own values
    chunk_lens: jax.Array | None = None  # [B] int32 prefill: valid chunk tokens per row (0..T)
    skip_empty: bool = False  # mask cached positions whose logit is exactly zero

    def check_decode(self, q: jax.Array) -> PoolDims:
        """Checks a decode call: q `[B, H_q, D]` and no chunk."""
        chunk = [n for n in ("chunk_k", "chunk_v", "chunk_lens") if getattr(self, n) is not None]
        _require(not chunk, f"decode takes no chunk, got {'/'.join(chunk)} (prefill's fields)")
        return self._check_rows(q, ("B", "num_q_heads"))

    def check_prefill(self, q: jax.Array) -> PoolDims:
        """Checks a prefill call: q `[B, T, H_q, D]`, chunk_k/v `[B, T, H_kv, D]` and
        chunk_lens `[B]` int32."""
        for name in ("chunk_k", "chunk_v", "chunk_lens"):
            _require(getattr(self, name) is not None, f"prefill needs {name}, got None")
        dims = self._check_rows(q, ("B", "T", "num_q_heads"))
        chunk_shape = (*q.shape[:2], dims.num_kv_heads, dims.head_dim)
        for name, x in (("chunk_k", self.chunk_k), ("chunk_v", self.chunk_v)):
            _require(
                x.shape == chunk_shape,
                f"{name} must be [B, T, num_kv_heads, head_dim] = {_shape_str(chunk_shape)}, "
                f"got {_shape_str(x.shape)}",
            )
        _check_lens("chunk_lens", self.chunk_lens, q.shape[0])
        return dims

    def _check_rows(self, q: jax.Array, q_axes: tuple[str, ...]) -> PoolDims:
        """Checks the pool, its scales, q (`[*q_axes, head_dim]`), the page tables and the
        cached lengths of q's B rows."""
        dims = _check_pool(self.k_pages, self.v_pages)
        _check_scales(self.k_pages, self.k_scales, self.v_scales)
        _require(
            q.ndim == len(q_axes) + 1,
            f"q must be [{', '.join(q_axes)}, head_dim={dims.head_dim}], got "
            f"{_shape_str(q.shape)}",
        )
        _check_query_heads(q, dims)
        batch = q.shape[0]
        _require(
            self.page_tables.ndim == 2 and self.page_tables.shape[0] == batch,
            f"page_tables must be [B={batch}, max_pages_per_seq], got "
            f"{_shape_str(self.page_tables.shape)}",
        )
        _check_int32("page_tables", self.page_tables)
        _check_lens("cached_lens", self.cached_lens, batch)
        return dims


def _shape_str(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_pool(k_pages: jax.Array, v_pages: jax.Array) -> PoolDims:
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


def _check_scales(
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


def _check_query_heads(q: jax.Array, dims: PoolDims) -> None:
    """Checks the last two axes of `q` are `[H_q, D]` with `H_q` a multiple of `H_kv`."""
    num_q_heads, head_dim = q.shape[-2:]
    _require(
        head_dim == dims.head_dim,
        f"q head_dim must equal the pool's head_dim {dims.head_dim}, got {_shape_str(q.shape)}",
    )
    _require(
        num_q_heads % dims.num_kv_heads == 0,
        f"q num_q_heads ({num_q_heads}) must be a multiple of the pool's num_kv_heads "
        f"({dims.num_kv_heads})",
    )


def _check_int32(name: str, x: jax.Array) -> None:
    _require(x.dtype == jnp.int32, f"{name} must be int32, got {x.dtype}")


def _check_lens(name: str, x: jax.Array, batch: int) -> None:
    _require(x.shape == (batch,), f"{name} must be [B={batch}], got {_shape_str(x.shape)}")
    _check_int32(name, x)
