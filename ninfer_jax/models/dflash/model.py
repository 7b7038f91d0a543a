"""The DFlash / DFlash2 block drafter's forward pass: a whole block of drafts in one pass.

The drafter proposes K tokens at once. Its input block is the last committed token (the
anchor, at the frontier position f) followed by K mask tokens (positions f + 1 .. f + K), as the
target's input embeddings; its context is the target's hidden features at every committed
position before f: the outputs of `target_layer_ids`, concatenated, projected by `fc` and
normed (`hidden_norm`). Each drafter layer attends from the block to [context K/V ; block K/V]
(non-causal inside the block unless the config says causal; sliding layers hide keys
`sliding_window` or more positions away), so the block's hidden states at positions 1..K give
the K drafts' logits through the target's lm head (times `output_multiplier`, soft-capped).

A context position's K/V in layer n depends only on that position's features (`context_kv`):
the Program computes it once, when the target processes the position, and keeps a window of
it per sequence (its StateImage), never the features themselves.

DFlash2 adds, per layer, a grouped dynamic causal convolution over the block before the
attention and the MLP and after each (`attention_conv`, `mlp_conv`), and the candidate selector,
the optimized proposal head: each position's top-k lm-head candidates rescored with a low-rank
bigram term between the previous chosen token and each candidate (`selector_scores`), chosen
position by position along the block.

Pure functions of (params, static config, arrays); sampling and its random streams belong to the
Program. Norms are Qwen3's plain RMSNorm (x * w); RoPE rotates the whole head (rope_theta).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from ninfer_jax.models.dflash.config import SLIDING, DFlashConfig
from ninfer_jax.models.qwen3_6.attention import _grouped_attention
from ninfer_jax.models.qwen3_6.layers import apply_rope, dense, linear32, swiglu


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Qwen3's RMSNorm: x * rsqrt(mean(x^2) + eps) in fp32, cast back, times w."""
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)
    return weight.astype(x.dtype) * y


def rope_cos_sin(positions: jax.Array, cfg: DFlashConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., head_dim] (fp32) for integer positions [...]: RoPE over the whole head."""
    half = jnp.arange(0, cfg.head_dim, 2, dtype=jnp.float32) / cfg.head_dim
    freqs = positions.astype(jnp.float32)[..., None] * (1.0 / cfg.rope_theta**half)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def context_params(params: dict) -> dict:
    """The drafter's params `context_kv` reads: what a round that only keeps the drafter's
    context current passes, not every drafter leaf (each leaf passed costs the call host time,
    though the executable never reads it)."""
    return {"fc": params["fc"], "hidden_norm": params["hidden_norm"],
            "layers": tuple({k: p[k] for k in ("k", "k_norm", "v")} for p in params["layers"])}


def context_kv(params: dict, cfg: DFlashConfig, features: jax.Array, positions: jax.Array
               ) -> tuple[jax.Array, jax.Array]:
    """The context K/V of T positions in every drafter layer.

    features [B, T, F * H]: the target's outputs of `target_layer_ids` at those positions,
    concatenated in that order; positions [B, T] int32 absolute. Returns (k, v), each
    [B, T, L, Hkv, D] (k normed and rotated).
    """
    b, t, _ = features.shape
    ctx = rms_norm(dense(features, params["fc"]), params["hidden_norm"], cfg.rms_norm_eps)
    cos, sin = rope_cos_sin(positions, cfg)
    ks, vs = [], []
    for p in params["layers"]:
        k = dense(ctx, p["k"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        ks.append(apply_rope(rms_norm(k, p["k_norm"], cfg.rms_norm_eps), cos, sin))
        vs.append(dense(ctx, p["v"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim))
    return jnp.stack(ks, axis=2), jnp.stack(vs, axis=2)


def _convolve(h: jax.Array, dynamic: jax.Array, base: jax.Array, group_size: int) -> jax.Array:
    """The grouped dynamic causal convolution along the block. h [B, T, H]; dynamic
    [B, T, ks, G] per-position, per-group kernel offsets; base [ks, H] the static kernel.
    out[t] = sum_o (base[o] + dynamic[t, o]) * h[t - o] (zero before the block's start)."""
    b, t, hidden = h.shape
    groups = hidden // group_size
    blocks = h.reshape(b, t, groups, group_size)
    out = jnp.zeros_like(blocks)
    for offset in range(base.shape[0]):
        shifted = blocks if offset == 0 else jnp.pad(
            blocks[:, :-offset], ((0, 0), (offset, 0), (0, 0), (0, 0)))
        kernel = base[offset].reshape(groups, group_size).astype(h.dtype)
        out = out + kernel * shifted + dynamic[:, :, offset, :, None] * shifted
    return out.reshape(b, t, hidden)


def _conv_prepare(p: dict, h: jax.Array, cfg: DFlashConfig) -> tuple[jax.Array, jax.Array]:
    """The convolution before a sublayer; returns (its output, the kernel offsets of the one
    after it) [B, T, ks, G]."""
    b, t, hidden = h.shape
    ks, groups = cfg.conv_kernel_size, hidden // cfg.conv_group_size
    dynamic = dense(h, p["proj"]).reshape(b, t, 2, ks, groups)
    return (_convolve(h, dynamic[:, :, 0], p["base"][0], cfg.conv_group_size),
            dynamic[:, :, 1])


def _conv_finish(p: dict, h: jax.Array, dynamic: jax.Array, cfg: DFlashConfig) -> jax.Array:
    return _convolve(h, dynamic, p["base"][1], cfg.conv_group_size)


def _mask(cfg: DFlashConfig, layer: int, q_pos: jax.Array, key_pos: jax.Array,
          key_ok: jax.Array) -> jax.Array:
    """[B, T, S] bool: which keys each block position sees in `layer`."""
    qp, kp = q_pos[:, :, None], key_pos[:, None, :]
    visible = key_ok[:, None, :]
    if cfg.causal[layer]:
        visible = visible & (kp <= qp)
    if cfg.layer_types[layer] == SLIDING:
        visible = visible & (qp - kp < cfg.sliding_window)
        if not cfg.causal[layer]:
            visible = visible & (kp - qp < cfg.sliding_window)
    return visible


def block_hidden(params: dict, cfg: DFlashConfig, block_embeds: jax.Array,
                 block_pos: jax.Array, ctx_k: jax.Array, ctx_v: jax.Array, ctx_pos: jax.Array,
                 ctx_ok: jax.Array) -> jax.Array:
    """The drafter's final-normed hidden states over a block.

    block_embeds [B, T, H]: the target's input embeddings of [anchor, mask * K] (times
    `input_embedding_scale`); block_pos [B, T] int32 absolute positions; ctx_k, ctx_v
    [B, N, L, Hkv, D]: N context entries' K/V (`context_kv`); ctx_pos [B, N] int32 their
    positions; ctx_ok [B, N] bool: which entries hold context (the rest is never seen).
    Returns [B, T, H]; positions 1..T-1 carry the drafts.
    """
    b, t, _ = block_embeds.shape
    eps = cfg.rms_norm_eps
    cos, sin = rope_cos_sin(block_pos, cfg)
    key_pos = jnp.concatenate([ctx_pos, block_pos], axis=1)
    key_ok = jnp.concatenate([ctx_ok, jnp.ones((b, t), bool)], axis=1)
    h = block_embeds
    for n, p in enumerate(params["layers"]):
        x = rms_norm(h, p["input_norm"], eps)
        if cfg.has_conv:
            x, kernel = _conv_prepare(p["attn_conv"], x, cfg)
        q = dense(x, p["q"]).reshape(b, t, cfg.num_q_heads, cfg.head_dim)
        q = apply_rope(rms_norm(q, p["q_norm"], eps), cos, sin)
        k = dense(x, p["k"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        k = apply_rope(rms_norm(k, p["k_norm"], eps), cos, sin)
        v = dense(x, p["v"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        keys = jnp.concatenate([ctx_k[:, :, n].astype(k.dtype), k], axis=1)
        values = jnp.concatenate([ctx_v[:, :, n].astype(v.dtype), v], axis=1)
        out = _grouped_attention(q, keys, values, _mask(cfg, n, block_pos, key_pos, key_ok))
        y = dense(out.reshape(b, t, cfg.num_q_heads * cfg.head_dim), p["o"])
        if cfg.has_conv:
            y = _conv_finish(p["attn_conv"], y, kernel, cfg)
        h = h + y
        x = rms_norm(h, p["post_norm"], eps)
        if cfg.has_conv:
            x, kernel = _conv_prepare(p["mlp_conv"], x, cfg)
        y = swiglu(p, x)
        if cfg.has_conv:
            y = _conv_finish(p["mlp_conv"], y, kernel, cfg)
        h = h + y
    return rms_norm(h, params["norm"], eps)


def block_logits(cfg: DFlashConfig, hidden: jax.Array, head: jax.Array) -> jax.Array:
    """The full lm-head proposal: logits [..., V] fp32 from the drafter's hidden states and the
    target's head [V, H], scaled by `output_multiplier` and soft-capped."""
    logits = linear32(hidden, head) * cfg.output_multiplier
    cap = cfg.final_logit_softcapping
    return jnp.tanh(logits / cap) * cap if cap > 0 else logits


def selector_scores(params: dict, cfg: DFlashConfig, hidden: jax.Array,
                    predecessor: jax.Array, unary: jax.Array, candidates: jax.Array
                    ) -> jax.Array:
    """One block position's candidate scores [B, k] fp32: the candidates' proposal logits
    (unary [B, k]) plus <pred[predecessor] * proj(hidden), succ[candidate]>. hidden [B, H];
    predecessor [B] int32, the token chosen at the position before; candidates [B, k] int32."""
    s = params["selector"]
    projected = linear32(hidden, s["proj"])  # [B, r]
    pred = s["pred"][predecessor].astype(jnp.float32)
    succ = s["succ"][candidates].astype(jnp.float32)  # [B, k, r]
    return unary + jnp.einsum("br,bkr->bk", pred * projected, succ)


Choose = Callable[[int, jax.Array, jax.Array], jax.Array]


def select(params: dict, cfg: DFlashConfig, hidden: jax.Array, logits: jax.Array,
           anchor: jax.Array, choose: Choose) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The candidate selector along a block. hidden [B, K, H] and logits [B, K, V] at the draft
    positions; anchor [B] int32. `choose(j, scores [B, k], candidates [B, k])` returns the
    chosen candidate's index [B] at position j (argmax for greedy rows, a draw for sampled
    ones). Returns (drafts [B, K] int32, candidates [B, K, k] int32, scores [B, K, k] fp32,
    each position's scores given the token chosen before it)."""
    unary, candidates = jax.lax.top_k(logits, cfg.selector_top_k)
    candidates = candidates.astype(jnp.int32)
    predecessor = anchor.astype(jnp.int32)
    drafts, all_scores = [], []
    rows = jnp.arange(hidden.shape[0])
    for j in range(hidden.shape[1]):
        scores = selector_scores(params, cfg, hidden[:, j], predecessor, unary[:, j],
                                 candidates[:, j])
        predecessor = candidates[rows, j, choose(j, scores, candidates[:, j])]
        drafts.append(predecessor)
        all_scores.append(scores)
    return jnp.stack(drafts, axis=1), candidates, jnp.stack(all_scores, axis=1)


def greedy(j: int, scores: jax.Array, candidates: jax.Array) -> jax.Array:
    """`Choose` for greedy rows: the best-scoring candidate."""
    return jnp.argmax(scores, axis=-1)
