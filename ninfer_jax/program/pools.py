"""Device pools, allocated once at start-up, and the paged K/V access the model layers use.

Owns the physical layout (DESIGN §10): attention K/V in pages `[layers, pages, page_size,
kv_heads, head_dim]`; GDN state in committed slots (conv in the activation dtype, recurrent in
fp32) plus provisional rows that the step in flight writes and `commit` copies into slots, so an
abort leaves committed state untouched; checkpoint slots holding the GDN part of prefix
checkpoints (their K/V stay in shared pages); per-slot penalty state for sampling. At run time only
the contents change, never the shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.program.config import ProgramConfig
from pallas_kernels.paged_attention import paged_attention_decode, paged_prefill_attention_reference


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["k", "v", "conv", "rec", "prov_conv", "prov_rec", "ck_conv", "ck_rec",
                 "output_counts", "prompt_mask"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Pools:
    k: jax.Array  # [La, P, page_size, Hkv, D] dtype
    v: jax.Array  # [La, P, page_size, Hkv, D] dtype
    conv: jax.Array  # [Ll, S, conv_dim, K-1] dtype, committed GDN conv state per slot
    rec: jax.Array  # [Ll, S, Hv, dk, dv] float32, committed GDN recurrent state per slot
    prov_conv: jax.Array  # [Ll, Bmax, conv_dim, K-1] provisional rows of the step in flight
    prov_rec: jax.Array  # [Ll, Bmax, Hv, dk, dv] float32
    ck_conv: jax.Array  # [Ll, C, conv_dim, K-1] checkpoint images' conv state
    ck_rec: jax.Array  # [Ll, C, Hv, dk, dv] float32 checkpoint images' recurrent state
    output_counts: jax.Array  # [S, V] int32, committed generated-token counts per slot
    prompt_mask: jax.Array  # [S, V] bool, tokens of each slot's prompt

    @classmethod
    def allocate(cls, cfg: ModelConfig, pcfg: ProgramConfig) -> "Pools":
        dtype = jnp.dtype(pcfg.dtype)
        la, ll, s, b = cfg.num_attention_layers, cfg.num_linear_layers, pcfg.num_slots, \
            pcfg.max_concurrency
        kv_shape = (la, pcfg.num_pages, pcfg.page_size, cfg.num_kv_heads, cfg.head_dim)
        conv = (cfg.conv_dim, cfg.conv_kernel - 1)
        rec = (cfg.linear_num_v_heads, cfg.linear_k_dim, cfg.linear_v_dim)
        return cls(
            k=jnp.zeros(kv_shape, dtype), v=jnp.zeros(kv_shape, dtype),
            conv=jnp.zeros((ll, s, *conv), dtype), rec=jnp.zeros((ll, s, *rec), jnp.float32),
            prov_conv=jnp.zeros((ll, b, *conv), dtype),
            prov_rec=jnp.zeros((ll, b, *rec), jnp.float32),
            ck_conv=jnp.zeros((ll, pcfg.num_checkpoint_slots, *conv), dtype),
            ck_rec=jnp.zeros((ll, pcfg.num_checkpoint_slots, *rec), jnp.float32),
            output_counts=jnp.zeros((s, cfg.vocab_size), jnp.int32),
            prompt_mask=jnp.zeros((s, cfg.vocab_size), bool),
        )


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["layers", "page_tables", "lengths", "num_valid"],
                   meta_fields=["impl"])
@dataclasses.dataclass(frozen=True)
class PagedKV:
    """`KVAccess` over the page pool.

    Row b's new tokens go to positions lengths[b] + t for t < num_valid[b] (padding is dropped,
    never written); a token attends to every position of its row up to itself.
    """

    layers: tuple[jax.Array, jax.Array]  # (k, v) [La, P, page_size, Hkv, D]
    page_tables: jax.Array  # [B, max_pages_per_seq] int32
    lengths: jax.Array  # [B] int32 positions already in the pages
    num_valid: jax.Array  # [B] int32 real tokens among this call's T
    impl: str  # decode attention: "reference" | "pallas"

    def with_layers(self, layers):
        return dataclasses.replace(self, layers=layers)

    def attend(self, layers, layer, q, k, v):
        k_all, v_all = layers
        num_layers, num_pages, page_size = k_all.shape[:3]
        # One flat page space over all layers (a free reshape): layer l's page p is l * P + p,
        # so writes scatter into the pool in place and attention gathers only the row's pages.
        flat = (num_layers * num_pages, *k_all.shape[2:])
        k_flat, v_flat = k_all.reshape(flat), v_all.reshape(flat)
        tables = self.page_tables + layer * num_pages
        b, t = q.shape[:2]
        positions = self.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        valid = jnp.arange(t)[None, :] < self.num_valid[:, None]
        page = jnp.take_along_axis(tables, positions // page_size, axis=1, mode="clip")
        page = jnp.where(valid, page, flat[0])  # out of range: the write is dropped
        offset = positions % page_size
        k_flat = k_flat.at[page, offset].set(k.astype(k_flat.dtype), mode="drop")
        v_flat = v_flat.at[page, offset].set(v.astype(v_flat.dtype), mode="drop")
        if t == 1:
            out = paged_attention_decode(q[:, 0], k_flat, v_flat, tables,
                                         self.lengths + self.num_valid, impl=self.impl)[:, None]
        else:
            out = jax.vmap(paged_prefill_attention_reference,
                           in_axes=(0, None, None, 0, 0, 0, 0, 0))(
                q, k_flat, v_flat, tables, self.lengths, k, v, self.num_valid)
        return out.astype(q.dtype), (k_flat.reshape(k_all.shape), v_flat.reshape(v_all.shape))
