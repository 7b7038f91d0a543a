"""Gated full attention and the small interface through which it reads and writes K/V.

Owns the attention maths of DESIGN §14 (interleaved [q | gate] per head, q/k zero-centred
RMSNorm, partial RoPE, GQA with scale head_dim^-0.5, output * sigmoid(gate)). Where K/V live is
not its business: every call goes through a `KVAccess`, so the layer code is the same for a
plain causal forward, a contiguous cache, and the Program's paged pools.

A `KVAccess` is a pytree. `layers` holds every attention layer's K/V (leaves with a leading
[num_attention_layers] axis); it travels through the layer loop as carried state and
`attend(layers, layer, q, k, v)` writes the new K/V of layer `layer` in place and reads only
what the attention needs, so a step never copies a whole cache. Everything else (lengths, page
tables) is shared by all layers.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from ninfer_jax.models.qwen3_6.config import ModelConfig
from ninfer_jax.models.qwen3_6.layers import apply_rope, dense, einsum32, rms_norm


class KVAccess(Protocol):
    """How attention layers reach their K/V (see module docstring)."""

    layers: Any

    def attend(self, layers: Any, layer: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array
               ) -> tuple[jax.Array, Any]:
        """q [B, T, Hq, D] (normed, roped); k, v [B, T, Hkv, D] for the new tokens of attention
        layer `layer` (an int32 scalar). Returns (out [B, T, Hq, D], updated layers)."""
        ...

    def with_layers(self, layers: Any) -> KVAccess:
        ...


def _grouped_attention(q, k, v, mask):
    """q [B, T, Hq, D]; k, v [B, S, Hkv, D]; mask [B, T, S] bool (or broadcastable to it).
    Softmax in fp32.

    The query heads of one K/V head and all T positions are the rows of one [T * G, D] x
    [D, S] product per K/V head (a [T, D] product per query head took XLA:CPU 3x as long: the
    demo model's 16 x 256 rows, 17.9 -> 5.7 ms a layer)."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    rows = jnp.swapaxes(q.reshape(b, t, hkv, g, d), 1, 2).reshape(b, hkv, t * g, d)
    s = k.shape[1]
    mask = jnp.broadcast_to(mask[:, :, None], (b, t, g, s)).reshape(b, 1, t * g, s)
    scores = einsum32("bkqd,bskd->bkqs", rows, k) * (d**-0.5)
    scores = jnp.where(mask, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask.any(-1, keepdims=True), probs, 0.0).astype(v.dtype)
    out = einsum32("bkqs,bskd->bkqd", probs, v)
    return jnp.swapaxes(out.reshape(b, hkv, t, g, d), 1, 2).reshape(b, t, hq, d).astype(q.dtype)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["layers"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class CausalKV:
    """No cache: plain causal attention over the tokens of this call (full forward)."""

    layers: None = None

    def attend(self, layers, layer, q, k, v):
        t = q.shape[1]
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (q.shape[0], t, t))
        return _grouped_attention(q, k, v, mask), layers

    def with_layers(self, layers):
        return self


@functools.partial(jax.tree_util.register_dataclass, data_fields=["segments", "layers"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class SegmentedCausalKV:
    """No cache: causal attention over the tokens of this call within segments (a packed row
    of several texts): a token sees the earlier tokens of its own segment only."""

    segments: jax.Array  # [B, T] int32, the text each token belongs to
    layers: None = None

    def attend(self, layers, layer, q, k, v):
        t = q.shape[1]
        same = self.segments[:, :, None] == self.segments[:, None, :]
        return _grouped_attention(q, k, v, jnp.tril(jnp.ones((t, t), bool)) & same), layers

    def with_layers(self, layers):
        return self


@functools.partial(jax.tree_util.register_dataclass, data_fields=["layers", "lengths"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class ContiguousKV:
    """A contiguous per-row cache: the new tokens of row b go to positions lengths[b]...

    layers = (k, v), each [L, B, S_max, Hkv, D]. lengths [B] int32: cached positions before
    this call. A token at position p attends to every cached or new position <= p.
    """

    layers: tuple[jax.Array, jax.Array]
    lengths: jax.Array  # [B] int32

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> ContiguousKV:
        shape = (cfg.num_attention_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return cls(layers=(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)),
                   lengths=jnp.zeros((batch,), jnp.int32))

    def attend(self, layers, layer, q, k, v):
        k_all, v_all = layers
        b, t = q.shape[:2]
        rows = jnp.arange(b)[:, None]
        q_pos = self.lengths[:, None] + jnp.arange(t)[None, :]  # [B, T]
        k_all = k_all.at[layer, rows, q_pos].set(k.astype(k_all.dtype), mode="drop")
        v_all = v_all.at[layer, rows, q_pos].set(v.astype(v_all.dtype), mode="drop")
        s = k_all.shape[2]
        mask = jnp.arange(s)[None, None, :] <= q_pos[:, :, None]
        out = _grouped_attention(q, k_all[layer], v_all[layer], mask)
        return out, (k_all, v_all)

    def with_layers(self, layers):
        return dataclasses.replace(self, layers=layers)

    def advance(self, num_new: jax.Array) -> ContiguousKV:
        """The cache after `num_new` [B] tokens per row were committed."""
        return dataclasses.replace(self, lengths=self.lengths + num_new)


def attention_kv(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array,
                 cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The K/V [B, T, Hkv, D] (normed, roped) a gated-attention layer stores for x [B, T, H]
    (after input_layernorm)."""
    b, t, _ = x.shape
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    k = rms_norm(dense(x, p["k"]).reshape(b, t, hkv, d), p["k_norm"], cfg.rms_norm_eps)
    return apply_rope(k, cos, sin), dense(x, p["v"]).reshape(b, t, hkv, d)


def attention_mixer(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array,
                    kv: KVAccess, kv_layers: Any, layer: jax.Array, cfg: ModelConfig):
    """One gated-attention layer's mixer (after input_layernorm).

    x [B, T, H]; cos/sin [B, T, rotary_dim]; layer: this layer's index among the attention
    layers. Returns (y [B, T, H], kv_layers with this layer's new K/V written).
    """
    b, t, _ = x.shape
    hq, d = cfg.num_q_heads, cfg.head_dim
    q_gate = dense(x, p["q"]).reshape(b, t, hq, 2 * d)
    q, gate = q_gate[..., :d], q_gate[..., d:].reshape(b, t, hq * d)
    q = apply_rope(rms_norm(q, p["q_norm"], cfg.rms_norm_eps), cos, sin)
    k, v = attention_kv(p, x, cos, sin, cfg)
    out, kv_layers = kv.attend(kv_layers, layer, q, k, v)
    out = out.reshape(b, t, hq * d) * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(x.dtype)
    return dense(out, p["o"]), kv_layers
