"""Device pools, allocated once at start-up, and the paged K/V access the model layers use.

Owns the physical layout (DESIGN §10): attention K/V in pages, all layers in one flat page space
`[layers * (pages + 1), page_size, kv_heads, head_dim]` (each layer's last page is a sink for
padding writes; with MTP speculation the head's attention layers follow the model's, so a
sequence's pages hold its MTP K/V too), in the program dtype or, with `kv_dtype="int8"`, as INT8
with a float32 scale per token and kv head (`k_scale`, `v_scale`: quantized as they are
written, dequantized page by page inside attention); committed GDN state, penalty state and the MTP context
(the main model's hidden state at the frontier's last position) per slot, plus one sink slot
that rejected rows are written to; provisional rows (one per batch row, with the GDN state and
MTP context after each of the step's T = verify_width positions) that the step in flight writes
and a commit copies into slots at the accepted length, so an abort leaves committed state
untouched; checkpoint slots holding the GDN state and MTP context of prefix checkpoints (their
K/V stay in shared pages). Slots and rows lead every state array, so one is a contiguous
block. At run time only the contents change, never the shapes.

With a DFlash drafter, each slot and checkpoint slot also holds the drafter's context window:
its layers' K/V of the last committed positions, in a ring of R entries (position p at entry
p % R, entry R a sink for padding). It is part of the sequence's state (and of a checkpoint's
StateImage), not of the paged K/V. Steps write it directly at positions >= the frontier (a
rejected position is rewritten before it is read); `context_ring` sizes R so that those writes
never reach a position the next block still sees.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ninfer_jax.models.dflash import DFlashConfig
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.program.config import ProgramConfig
from pallas_kernels.paged_attention import (
    PagedAttentionInputs,
    dequantize,
    paged_attention_decode,
    paged_attention_prefill,
    quantize,
)
from pallas_kernels.paged_attention.inputs import HEAD_AXIS
from pallas_kernels.paged_attention.quant import SCALE_DTYPE
from pallas_kernels.platform import per_device


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k", "v", "conv", "rec", "ctx", "prov_conv", "prov_rec", "prov_ctx", "ck_conv",
                 "ck_rec", "ck_ctx", "output_counts", "prompt_mask", "dk", "dv", "ck_dk",
                 "ck_dv", "k_scale", "v_scale"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Pools:
    # La counts the MTP head's attention layers too when speculation is on. The page dtype is
    # the program dtype, or int8 with kv_dtype="int8" (then with k_scale and v_scale).
    k: jax.Array  # [La * (P + 1), page_size, Hkv, D] page dtype: layer l's page p at l * (P+1) + p
    v: jax.Array  # [La * (P + 1), page_size, Hkv, D] page dtype (page P of each layer: the sink)
    conv: jax.Array  # [S + 1, Ll, conv_dim, K-1] dtype, committed GDN conv state per slot
    rec: jax.Array  # [S + 1, Ll, Hv, dk, dv] float32, committed recurrent state (slot S: sink)
    ctx: jax.Array  # [S + 1, H] dtype, committed MTP context: the hidden state at frontier - 1
    prov_conv: jax.Array  # [Bmax, T, Ll, conv_dim, K-1] provisional rows: after each position
    prov_rec: jax.Array  # [Bmax, T, Ll, Hv, dk, dv] float32
    prov_ctx: jax.Array  # [Bmax, T, H] dtype
    ck_conv: jax.Array  # [C, Ll, conv_dim, K-1] checkpoint images' conv state
    ck_rec: jax.Array  # [C, Ll, Hv, dk, dv] float32 checkpoint images' recurrent state
    ck_ctx: jax.Array  # [C, H] dtype checkpoint images' MTP context
    output_counts: jax.Array  # [S + 1, V] int32, committed generated-token counts per slot
    prompt_mask: jax.Array  # [S, V] bool, tokens of each slot's prompt
    # The DFlash drafter's context window (None without a drafter): Ld drafter layers
    dk: jax.Array | None = None  # [S + 1, R + 1, Ld, Hkv_d, D_d] dtype, K per slot
    dv: jax.Array | None = None  # [S + 1, R + 1, Ld, Hkv_d, D_d] dtype
    ck_dk: jax.Array | None = None  # [C, R + 1, Ld, Hkv_d, D_d] dtype, per checkpoint slot
    ck_dv: jax.Array | None = None  # [C, R + 1, Ld, Hkv_d, D_d] dtype
    # INT8 pages' scales (None for float pages): position t's K in kv head h is k[.., t, h] *
    # k_scale[.., t, h]
    k_scale: jax.Array | None = None  # [La * (P + 1), page_size, Hkv] float32
    v_scale: jax.Array | None = None  # [La * (P + 1), page_size, Hkv] float32

    @property
    def kv(self) -> tuple[jax.Array, ...]:
        """The paged K/V arrays, all indexed by flat page first: (k, v), or (k, v, k_scale,
        v_scale) for INT8 pages. A page image holds each one's rows of the page, in this
        order."""
        if self.k_scale is None:
            return self.k, self.v
        return self.k, self.v, self.k_scale, self.v_scale

    def with_kv(self, kv: tuple[jax.Array, ...]) -> Pools:
        """These pools with the paged K/V arrays `kv` (in `Pools.kv`'s order)."""
        return dataclasses.replace(self, **dict(zip(("k", "v", "k_scale", "v_scale"), kv)))

    @classmethod
    def allocate(cls, cfg: ModelConfig, pcfg: ProgramConfig, mtp_layers: int = 0,
                 drafter: DFlashConfig | None = None) -> Pools:
        """Zeroed pools; `mtp_layers`: the MTP head's attention layers (their K/V pages);
        `drafter`: a DFlash drafter's config (its context windows)."""
        dtype = jnp.dtype(pcfg.dtype)
        la, s, b = cfg.num_attention_layers + mtp_layers, pcfg.num_slots, pcfg.max_concurrency
        t, h = pcfg.verify_width, cfg.hidden_size
        kv_shape = (la * (pcfg.num_pages + 1), pcfg.page_size, cfg.num_kv_heads, cfg.head_dim)
        conv = (cfg.num_linear_layers, cfg.conv_dim, cfg.conv_kernel - 1)
        rec = (cfg.num_linear_layers, cfg.linear_num_v_heads, cfg.linear_k_dim,
               cfg.linear_v_dim)
        c = pcfg.num_checkpoint_slots
        pages = jnp.dtype(pcfg.page_dtype)
        scales = {} if pages != jnp.int8 else {"k_scale": jnp.zeros(kv_shape[:3], SCALE_DTYPE),
                                               "v_scale": jnp.zeros(kv_shape[:3], SCALE_DTYPE)}
        return cls(
            k=jnp.zeros(kv_shape, pages), v=jnp.zeros(kv_shape, pages), **scales,
            conv=jnp.zeros((s + 1, *conv), dtype), rec=jnp.zeros((s + 1, *rec), jnp.float32),
            ctx=jnp.zeros((s + 1, h), dtype),
            prov_conv=jnp.zeros((b, t, *conv), dtype),
            prov_rec=jnp.zeros((b, t, *rec), jnp.float32), prov_ctx=jnp.zeros((b, t, h), dtype),
            ck_conv=jnp.zeros((c, *conv), dtype), ck_rec=jnp.zeros((c, *rec), jnp.float32),
            ck_ctx=jnp.zeros((c, h), dtype),
            output_counts=jnp.zeros((s + 1, cfg.vocab_size), jnp.int32),
            prompt_mask=jnp.zeros((s, cfg.vocab_size), bool),
            **({} if drafter is None else _context_pools(drafter, pcfg, dtype)),
        )


def context_ring(drafter: DFlashConfig, pcfg: ProgramConfig) -> tuple[int, int]:
    """(R, kept): the ring's entries and how many positions before the frontier it holds.

    A block at frontier f sees context positions > f - W (W: the sliding window). A round writes
    positions f .. f + T - 1 (T = verify_width) before knowing which are accepted; in a ring of
    R = W + T those writes land on positions <= f - W - 1, which no later block sees. A drafter
    with a full-attention layer sees the whole context: R = max_seq_len, every position kept.
    """
    window, t = drafter.bounded_window, pcfg.verify_width
    if window is None or window + t >= pcfg.max_seq_len:
        return pcfg.max_seq_len, pcfg.max_seq_len
    return window + t, window


def _context_pools(drafter: DFlashConfig, pcfg: ProgramConfig, dtype) -> dict:
    ring, _ = context_ring(drafter, pcfg)
    entry = (ring + 1, drafter.num_layers, drafter.num_kv_heads, drafter.head_dim)
    s, c = pcfg.num_slots, pcfg.num_checkpoint_slots
    return {"dk": jnp.zeros((s + 1, *entry), dtype), "dv": jnp.zeros((s + 1, *entry), dtype),
            "ck_dk": jnp.zeros((c, *entry), dtype), "ck_dv": jnp.zeros((c, *entry), dtype)}


def context_positions(frontier: jax.Array, ring: int, kept: int
                      ) -> tuple[jax.Array, jax.Array]:
    """Which committed position each ring entry holds at `frontier` [B]: (positions [B, R + 1]
    int32, held [B, R + 1] bool). Entry i holds the latest position p < frontier with
    p % R == i, if p >= 0 and frontier - p <= kept; the sink entry R holds nothing."""
    i = jnp.arange(ring + 1, dtype=jnp.int32)[None, :]
    last = frontier[:, None] - 1
    pos = last - jnp.mod(last - i, ring)
    held = (pos >= 0) & (frontier[:, None] - pos <= kept) & (i < ring)
    return pos, held


def write_context(pool: jax.Array, slots: jax.Array, positions: jax.Array, valid: jax.Array,
                  ring: int, values: jax.Array) -> jax.Array:
    """pool [S + 1, R + 1, ...] with values [B, T, ...] written at (slots[b], positions[b, t] %
    R) where valid[b, t], and to the sink entry R elsewhere. The valid positions of a row must
    be distinct mod R (at most R of them)."""
    entry = jnp.where(valid, jnp.mod(positions, ring), ring)
    return pool.at[slots[:, None], entry].set(values.astype(pool.dtype),
                                               mode="promise_in_bounds")


def context_written(dk: jax.Array) -> jax.Array:
    """Which ring entries hold a position's K [B, R + 1] of dk [B, R + 1, Ld, Hkv, D]: an
    entry of K is normed and rotated, never all zeros (its norm weights are not), so zeros
    mark an entry a checkpoint image left out (`steps.capture_step`: what a bare round of 0
    did not write). A block reads an entry only where both this and `context_positions` hold,
    at positions from the row's `DecodeInputs.context_from`."""
    return jnp.any(dk[:, :, 0] != 0, axis=(-2, -1))


def write_rows(pool: jax.Array, rows: jax.Array, values: jax.Array) -> jax.Array:
    """pool [N, ...] with values [B, ...] written at rows [B] (distinct): one in-place
    dynamic-update-slice per row."""
    zeros = (jnp.zeros((), jnp.int32),) * (pool.ndim - 1)
    values = values.astype(pool.dtype)
    for b in range(rows.shape[0]):
        pool = jax.lax.dynamic_update_slice(pool, values[b:b + 1], (rows[b], *zeros))
    return pool


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["layers", "page_tables", "lengths", "num_valid"],
                   meta_fields=["impl", "pages_per_layer", "first_layer", "skip_empty"])
@dataclasses.dataclass(frozen=True)
class PagedKV:
    """`KVAccess` over the page pool.

    Row b's new tokens go to positions lengths[b] + t for t < num_valid[b] (padding is dropped,
    never written); a token attends to every position of its row up to itself. With INT8
    pages the new K/V are quantized as they are written, and a chunk attends to its own K/V
    quantized and dequantized: the numbers its pages hold, so a position's K/V read the same
    whether it is in the chunk or in the cache (chunked prefill, decode and a restored
    checkpoint agree).
    """

    layers: tuple[jax.Array, ...]  # `Pools.kv`: (k, v[, k_scale, v_scale]) [La * (P + 1), ...]
    page_tables: jax.Array  # [B, max_pages_per_seq] int32
    lengths: jax.Array  # [B] int32 positions already in the pages
    num_valid: jax.Array  # [B] int32 real tokens among this call's T
    impl: str  # decode attention: "reference" | "pallas"
    pages_per_layer: int  # P + 1: the pool's pages per attention layer, the sink included
    first_layer: int = 0  # pool layer of this access's layer 0 (the MTP head's follow the model's)
    # Cached positions whose logit is exactly zero are not read (`PagedAttentionInputs.
    # skip_empty`): the MTP head's entries a bare round left empty (zero key and value)
    skip_empty: bool = False

    def with_layers(self, layers):
        return dataclasses.replace(self, layers=layers)

    def attend(self, layers, layer, q, k, v):
        (k_flat, v_flat, *scales), tables, k, v = self._store(layers, layer, k, v)
        k_scales, v_scales = scales or (None, None)
        if q.shape[1] == 1:  # the new token is in the pages already
            out = attention(paged_attention_decode, self.impl, q[:, 0], 1, PagedAttentionInputs(
                k_flat, v_flat, tables, self.lengths + self.num_valid, k_scales, v_scales,
                skip_empty=self.skip_empty))
            out = out[:, None]
        else:
            chunks = PagedAttentionInputs(k_flat, v_flat, tables, self.lengths, k_scales,
                                          v_scales, chunk_k=k, chunk_v=v,
                                          chunk_lens=self.num_valid, skip_empty=self.skip_empty)
            out = attention(paged_attention_prefill, self.impl, q, 2, chunks)
        return out.astype(q.dtype), (k_flat, v_flat, *scales)

    def store(self, layers, layer, k, v):
        """Writes the new tokens' K/V [B, T, Hkv, D] of attention layer `layer` without
        attending (a layer whose output nobody reads); returns the updated layers."""
        return self._store(layers, layer, k, v)[0]

    def _store(self, layers, layer, k, v):
        """(updated layers, this layer's page tables, and k, v as the pages hold them)."""
        k_flat, v_flat, *scales = layers
        page_size = k_flat.shape[1]
        # Layer l's page p is l * (P + 1) + p; the last page of each layer is a sink that
        # padding tokens write to, so every write is in bounds and XLA updates the pool in
        # place (a dropped out-of-range write made it copy the whole pool every step).
        per_layer = self.pages_per_layer
        layer = layer + self.first_layer
        tables = self.page_tables + layer * per_layer
        t = k.shape[1]
        positions = self.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        valid = jnp.arange(t)[None, :] < self.num_valid[:, None]
        page = jnp.take_along_axis(tables, positions // page_size, axis=1, mode="clip")
        page = jnp.where(valid, page, layer * per_layer + per_layer - 1)
        offset = positions % page_size
        stored_k, stored_v = k, v
        if scales:  # INT8 pages: store int8 and scales; the chunk attends to what they read
            (stored_k, k_s), (stored_v, v_s) = quantize(k), quantize(v)
            scales = [_write(scales[0], page, offset, k_s), _write(scales[1], page, offset, v_s)]
            k, v = dequantize(stored_k, k_s, k.dtype), dequantize(stored_v, v_s, v.dtype)
        k_flat = _write(k_flat, page, offset, stored_k)
        v_flat = _write(v_flat, page, offset, stored_v)
        return (k_flat, v_flat, *scales), tables, k, v


def attention(kernel, impl: str, q: jax.Array, q_heads: int,
              inputs: PagedAttentionInputs) -> jax.Array:
    """`kernel(q, inputs, impl=impl)`; with the Pallas kernel on a tensor-parallel mesh, per
    device over its heads (`pallas_kernels.platform.per_device`): q's on axis `q_heads`, the
    inputs' on `HEAD_AXIS` of every array that has one (the page tables and lengths, of at
    most two axes, whole on every device). The output has q's heads."""
    attend = functools.partial(kernel, impl=impl)
    if impl != "pallas":
        return attend(q, inputs)
    leaves, tree = jax.tree.flatten(inputs)
    args = [(q, q_heads)] + [(x, HEAD_AXIS) if x.ndim > HEAD_AXIS else x for x in leaves]
    return per_device(lambda q, *leaves: attend(q, jax.tree.unflatten(tree, leaves)), args,
                      out_heads=q_heads)


def _write(pool: jax.Array, page: jax.Array, offset: jax.Array, new: jax.Array) -> jax.Array:
    """pool [N, page_size, ...] (K/V [.., Hkv, D] or scales [.., Hkv]) with new [B, T, ...]
    written at (page, offset) [B, T]. One token per row (decode) is a dynamic-update-slice per
    row, which XLA does in place; a scatter of one element became a select over the whole
    pool, i.e. a copy of it."""
    new = new.astype(pool.dtype)
    b, t = page.shape
    if t != 1:
        return pool.at[page, offset].set(new, mode="promise_in_bounds")
    zeros = (jnp.zeros((), jnp.int32),) * (pool.ndim - 2)
    for row in range(b):
        pool = jax.lax.dynamic_update_slice(pool, new[row:row + 1],
                                            (page[row, 0], offset[row, 0], *zeros))
    return pool
