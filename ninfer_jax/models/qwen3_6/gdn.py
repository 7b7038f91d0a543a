"""GatedDeltaNet (linear attention) mixer: causal conv, the gated delta rule, gated output norm.

Owns the GDN maths of DESIGN §14 and its per-sequence state: the conv state (the last
`conv_kernel - 1` pre-conv inputs) and the fp32 recurrent state `S [v_heads, k_dim, v_dim]`.
Multi-token input uses the chunked (UT-transform) form, one token the recurrent form; both
compute the same function; with `impl="pallas"` the same forms run as the Pallas kernels of
`pallas_kernels.gdn`. Padded tokens at the end of a row (`num_valid`) leave the state exactly as
the last valid token left it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from ninfer_jax.models.qwen3_6.config import ModelConfig
from ninfer_jax.models.qwen3_6.layers import dense, gated_rms_norm
from pallas_kernels.gdn import gated_delta_rule
from pallas_kernels.platform import per_device


@functools.partial(jax.tree_util.register_dataclass, data_fields=["conv", "recurrent"],
                   meta_fields=["impl"])
@dataclasses.dataclass(frozen=True)
class GDNState:
    """State of every GDN layer for B sequences (leading axis: linear layers)."""

    conv: jax.Array  # [L, B, conv_dim, conv_kernel - 1] activation dtype, oldest input first
    recurrent: jax.Array  # [L, B, v_heads, k_dim, v_dim] float32
    # How the layers update it: "reference" (the jnp forms below), "pallas" (the
    # `pallas_kernels.gdn` kernels; per device over the heads on a tensor-parallel mesh) or
    # "pallas_verify" (the kernel for verify windows, `keep_states`; the jnp forms otherwise)
    impl: str = "reference"

    @classmethod
    def zeros(cls, cfg: ModelConfig, batch: int, dtype=jnp.float32) -> GDNState:
        n = cfg.num_linear_layers
        return cls(
            conv=jnp.zeros((n, batch, cfg.conv_dim, cfg.conv_kernel - 1), dtype),
            recurrent=jnp.zeros(
                (n, batch, cfg.linear_num_v_heads, cfg.linear_k_dim, cfg.linear_v_dim), jnp.float32
            ),
        )


def _l2norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def recurrent_delta_rule(q, k, v, g, beta, state, keep_states: bool = False):
    """Token-by-token gated delta rule. q, k [B, T, H, dk] (normalised, q scaled);
    v [B, T, H, dv]; g, beta [B, T, H]; state [B, H, dk, dv]. All fp32.
    Returns (out [B, T, H, dv], final state), or with `keep_states` the state after every
    token, [B, T, H, dk, dv], in place of the final one."""

    def step(s, inputs):
        q_t, k_t, v_t, g_t, b_t = inputs
        decay = jnp.exp(g_t)[..., None, None]  # [B, H, 1, 1]
        # S' = decay S, so S'^T k and S'^T q come from one contraction of the old state, and
        # the output S''^T q = S'^T q + (k . q) delta: the state is read once for both and
        # once more for its update, which writes it (decode is memory-bound on it).
        kq = decay * jnp.einsum("bhkv,bhjk->bhjv", s, jnp.stack([k_t, q_t], axis=2))
        delta = (v_t - kq[:, :, 0]) * b_t[..., None]
        s = s * decay + k_t[..., :, None] * delta[..., None, :]
        return s, kq[:, :, 1] + jnp.sum(k_t * q_t, -1, keepdims=True) * delta

    if q.shape[1] == 1:  # one token (decode): no loop, which also compiles faster
        state, out = step(state, tuple(a[:, 0] for a in (q, k, v, g, beta)))
        return out[:, None], state[:, None] if keep_states else state
    def step_keep(s, inputs):
        s, o = step(s, inputs)
        return s, (o, s)

    xs = tuple(jnp.moveaxis(a, 1, 0) for a in (q, k, v, g, beta))
    if keep_states:
        _, (out, states) = jax.lax.scan(step_keep, state, xs)
        return jnp.moveaxis(out, 0, 1), jnp.moveaxis(states, 0, 1)
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state


INVERSE_BLOCK = 16  # rows solved by forward substitution; larger blocks are merged by matmuls
# The chunk of the jnp chunked form on XLA:CPU (at most the model's `gdn_chunk_size`, which the
# kernels use). Its batched [C, C] matmuls and masks cost less in chunks of 32 than of 64 on 2
# cores: the demo model's 32 x 128 packed scoring call 157 -> 144 ms; one MEDIUM-shaped layer
# (8/16 heads of 64) over 16 x 256 tokens 131 -> 86 ms, over 1 x 512 10.8 -> 7.2 ms.
CPU_CHUNK = 32
SCAN_UNROLL = 8  # chunks per iteration of the chunked form's loop over chunks


def reference_chunk(cfg: ModelConfig) -> int:
    """The chunk `gdn_mixer`'s jnp chunked form runs in: min(gdn_chunk_size, CPU_CHUNK) when
    tracing for XLA:CPU, else gdn_chunk_size. Chunking changes only rounding."""
    if jax.default_backend() == "cpu":
        return min(cfg.gdn_chunk_size, CPU_CHUNK)
    return cfg.gdn_chunk_size


def _diagonal_blocks(a: jax.Array, size: int) -> jax.Array:
    """[..., c, c] -> its c // size diagonal blocks [..., c // size, size, size]."""
    n = a.shape[-1] // size
    blocks = a.reshape(*a.shape[:-2], n, size, n, size)
    return jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)


def _inverse_unit_lower(a: jax.Array) -> jax.Array:
    """(I - a)^-1 for strictly lower-triangular a [..., c, c].

    Diagonal blocks of INVERSE_BLOCK rows are solved by forward substitution, all at once;
    then pairs of neighbouring blocks are merged until one block spans c:
    [[M1, 0], [M21, M2]]^-1 = [[T1, 0], [-T2 M21 T1, T2]] with M21 = -a21. The substitution's
    loop runs INVERSE_BLOCK - 1 steps instead of c - 1 (a loop step is a small op with a fixed
    cost; the merges are matmuls).
    """
    c = a.shape[-1]
    size = INVERSE_BLOCK if c % INVERSE_BLOCK == 0 and (c // INVERSE_BLOCK) & (
        c // INVERSE_BLOCK - 1) == 0 else c

    def substitute(i, m):
        row = m[..., i, :]
        return m.at[..., i, :].set(row + jnp.einsum("...j,...jk->...k", row, m))

    t = jax.lax.fori_loop(1, size, substitute, _diagonal_blocks(a, size))
    t = t + jnp.eye(size, dtype=a.dtype)
    while size < c:  # t: [..., n, size, size], the inverses of the diagonal blocks
        t1, t2 = t[..., 0::2, :, :], t[..., 1::2, :, :]
        a21 = _diagonal_blocks(a, 2 * size)[..., size:, :size]
        lower = t2 @ a21 @ t1
        top = jnp.concatenate([t1, jnp.zeros_like(t1)], axis=-1)
        t = jnp.concatenate([top, jnp.concatenate([lower, t2], axis=-1)], axis=-2)
        size *= 2
    return t[..., 0, :, :]


def chunked_delta_rule(q, k, v, g, beta, state, chunk_size: int, segments=None):
    """Chunked (UT-transform) gated delta rule, same contract as `recurrent_delta_rule`.

    Within a chunk the delta-rule updates are condensed into matmuls by inverting the unit
    lower-triangular system (I + A) with forward substitution (batched triangular solves are
    slow on XLA:CPU); chunks are then scanned with the state as carry.

    segments [B, T] int32 (a packed row: non-decreasing ids, one per text): the state restarts
    from zero at each segment's first token, so every segment gets the outputs it would get
    alone (the incoming `state` belongs to the first segment). Every product across a segment
    boundary inside a chunk is masked out.
    """
    b, t, h, _ = q.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = (-t) % c
    if pad:
        q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
        g, beta = (jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (g, beta))
        if segments is not None:  # padding joins the last segment: it neither decays nor writes
            segments = jnp.pad(segments, ((0, 0), (0, pad)), mode="edge")
    n = (t + pad) // c
    # [B, H, N, C, ...]
    q, k, v = (a.reshape(b, n, c, h, -1).transpose(0, 3, 1, 2, 4) for a in (q, k, v))
    g, beta = (a.reshape(b, n, c, h).transpose(0, 3, 1, 2) for a in (g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    lower = jnp.tril(jnp.ones((c, c), bool))
    strict = jnp.tril(jnp.ones((c, c), bool), -1)
    # Within a segment, decays from the chunk's start differ from decays from the segment's
    # start by a constant, which every product of the form exp(cum_i - cum_j) (i, j in one
    # segment) cancels; the rows that see the incoming state are those of the segment that
    # began before the chunk, whose two sums agree.
    cum = jnp.cumsum(g, axis=-1)
    if segments is None:
        carried = last = 1.0
    else:
        seg = segments.reshape(b, 1, n, c)  # [B, 1, N, C], broadcast over heads
        same = seg[..., :, None] == seg[..., None, :]
        lower, strict = lower & same, strict & same
        # The segment the incoming state belongs to: the last one of the chunk before.
        before = jnp.concatenate([seg[:, :, :1, 0], seg[:, :, :-1, -1]], axis=-1)[..., None]
        carried = (seg == before).astype(g.dtype)  # [B, 1, N, C]: rows that see the state
        last = (seg == seg[..., -1:]).astype(g.dtype)  # rows that write the outgoing state
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[..., :, None] - cum[..., None, :], 0.0)), 0.0)
    # (I + K)^-1 with K = strictly-lower(k_beta k^T * decay).
    t_inv = _inverse_unit_lower(jnp.where(strict, -(k_beta @ jnp.swapaxes(k, -1, -2)) * decay,
                                          0.0))
    new_v = t_inv @ v_beta
    k_cumdecay = t_inv @ (k_beta * (jnp.exp(cum) * carried)[..., None])
    intra = jnp.where(lower, (q @ jnp.swapaxes(k, -1, -2)) * decay, 0.0)
    q_dec = q * (jnp.exp(cum) * carried)[..., None]
    to_end = cum[..., -1:] - cum
    if segments is None:
        k_dec = k * jnp.exp(to_end)[..., None]
        chunk_decay = jnp.exp(cum[..., -1])[..., None, None]
    else:
        k_dec = k * (jnp.exp(jnp.where(last > 0, to_end, 0.0)) * last)[..., None]
        chunk_decay = (jnp.exp(cum[..., -1]) * carried[..., -1])[..., None, None]

    def per_chunk(s, xs):
        nv, kc, qd, kd, it, cd = xs
        v_new = nv - kc @ s
        out = qd @ s + it @ v_new
        s = s * cd + jnp.swapaxes(kd, -1, -2) @ v_new
        return s, out

    xs = tuple(jnp.moveaxis(a, 2, 0) for a in (new_v, k_cumdecay, q_dec, k_dec, intra, chunk_decay))
    # Unrolled by up to 8 chunks: a rolled loop sliced each chunk's inputs and stacked its
    # outputs through copies (MEDIUM's 16 x 256-token scoring call: ~3% of its time on CPU).
    state, out = jax.lax.scan(per_chunk, state, xs, unroll=min(n, SCAN_UNROLL))
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * c, dv)[:, :, :t]
    return out.transpose(0, 2, 1, 3), state


def gdn_mixer(p: dict, x: jax.Array, conv_state: jax.Array, rec_state: jax.Array,
              num_valid: jax.Array | None, cfg: ModelConfig, keep_states: bool = False,
              impl: str = "reference", segments: jax.Array | None = None):
    """One GDN layer's mixer (after input_layernorm).

    x [B, T, H]; conv_state [B, conv_dim, K-1]; rec_state [B, Hv, dk, dv] fp32;
    num_valid [B] int32 or None (all T valid). Returns (y [B, T, H], conv_state, rec_state).
    With `keep_states` (a speculative verify: the state at any accepted prefix is needed) the
    states come back after every token, conv [B, T, conv_dim, K-1] and rec [B, T, Hv, dk, dv],
    computed by the recurrent form; a padded token's entries are don't-care. `impl`: as
    `GDNState.impl`. segments [B, T] int32 or None: a packed row of several texts (see
    `chunked_delta_rule`; the conv reads no input of an earlier segment either); reference
    chunked form only.
    """
    bsz, t, _ = x.shape
    if segments is not None and (keep_states or impl != "reference"):
        raise ValueError("segments need the reference chunked form (no keep_states, no kernel)")
    kern = cfg.conv_kernel
    hk, hv, dk, dv = cfg.linear_num_k_heads, cfg.linear_num_v_heads, cfg.linear_k_dim, cfg.linear_v_dim
    mixed = dense(x, p["in_qkv"])  # [B, T, conv_dim]
    z = dense(x, p["in_z"]).reshape(bsz, t, hv, dv)
    b_gate = dense(x, p["in_b"])
    a_gate = dense(x, p["in_a"])

    # Causal depthwise conv over [previous K-1 inputs | this chunk].
    full = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2).astype(mixed.dtype), mixed], axis=1)
    w = p["conv"].astype(jnp.float32)  # [K, conv_dim]
    if segments is None:
        conv = sum(full[:, i : i + t].astype(jnp.float32) * w[i] for i in range(kern))
    else:  # an input counts only for the tokens of its own segment (the state: the first's)
        seg_full = jnp.concatenate([jnp.repeat(segments[:, :1], kern - 1, axis=1), segments], 1)
        conv = sum(jnp.where((seg_full[:, i : i + t] == segments)[..., None],
                             full[:, i : i + t].astype(jnp.float32), 0.0) * w[i]
                   for i in range(kern))
    conv = jax.nn.silu(conv).astype(x.dtype)
    if keep_states:  # the K-1 inputs ending at each token
        new_conv = jnp.stack([full[:, i + 1 : i + kern] for i in range(t)], axis=1)
        new_conv = jnp.swapaxes(new_conv, 2, 3).astype(conv_state.dtype)
        valid = None if num_valid is None else jnp.arange(t)[None, :] < num_valid[:, None]
    elif num_valid is None:
        new_conv = full[:, t:]
        valid = None
    else:
        # The K-1 inputs ending at the last valid token of each row.
        idx = num_valid[:, None] + jnp.arange(kern - 1)[None, :]
        new_conv = jnp.take_along_axis(full, idx[:, :, None], axis=1)
        valid = jnp.arange(t)[None, :] < num_valid[:, None]
    if not keep_states:
        new_conv = jnp.swapaxes(new_conv, 1, 2).astype(conv_state.dtype)

    q, k, v = jnp.split(conv.astype(jnp.float32), [cfg.linear_key_size, 2 * cfg.linear_key_size], -1)
    q = _l2norm(q.reshape(bsz, t, hk, dk)) * (dk**-0.5)
    k = _l2norm(k.reshape(bsz, t, hk, dk))
    v = v.reshape(bsz, t, hv, dv)
    if hv != hk:
        q, k = (jnp.repeat(a, hv // hk, axis=2) for a in (q, k))
    beta = jax.nn.sigmoid(b_gate.astype(jnp.float32))
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(
        a_gate.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32)
    )
    if valid is not None:  # padded tokens neither decay nor write the state
        beta = jnp.where(valid[..., None], beta, 0.0)
        g = jnp.where(valid[..., None], g, 0.0)
    if impl == "pallas" or (impl == "pallas_verify" and keep_states):
        rule = functools.partial(gated_delta_rule, chunk_size=cfg.gdn_chunk_size,
                                 keep_states=keep_states)
        heads = ((q, 2), (k, 2), (v, 2), (g, 2), (beta, 2), (rec_state, 1))
        out, rec = per_device(rule, heads, out_heads=(2, 2 if keep_states else 1))
    elif t == 1 or keep_states:
        out, rec = recurrent_delta_rule(q, k, v, g, beta, rec_state, keep_states)
    else:
        out, rec = chunked_delta_rule(q, k, v, g, beta, rec_state, reference_chunk(cfg),
                                      segments)
    out = gated_rms_norm(out.astype(x.dtype), z, p["norm"], cfg.rms_norm_eps)
    return dense(out.reshape(bsz, t, hv * dv), p["out"]), new_conv, rec
