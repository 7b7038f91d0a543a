"""Pallas (Triton backend) gated delta rule, token by token: decode and verify windows.

Owns the GDN recurrence for a few tokens per row (T = 1 decode, T = K + 1 speculative verify),
with the state in fp32: per token `S' = exp(g) S`, `delta = beta (v - S'^T k)`,
`S'' = S' + k delta^T`, `out = S''^T q`. Same contract as `ninfer_jax.models.qwen3_6.gdn.
recurrent_delta_rule`, its oracle (tests compare them).

Shape of the computation. The state's value columns are independent (each column's update reads
only that column), so the grid is `(B, H, dv / block_v)` and a program holds `[dk, block_v]` of
one head's state in registers for all T tokens: the state is read once and written once (or
once per token, `keep_states`), which is what the memory-bound decode step pays for.
Contractions over dk are elementwise products and sums (one row each, below Triton's 16-row
dot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

DEFAULT_BLOCK_V = 32


def pow2(n: int) -> int:
    """The smallest power of two >= n."""
    return 1 << max(n - 1, 0).bit_length()


def check_state(state: jax.Array, batch: int, heads: int, dk: int, dv: int) -> None:
    if state.shape != (batch, heads, dk, dv):
        raise ValueError(f"state must be [B, H, dk, dv] = {[batch, heads, dk, dv]}, got "
                         f"{list(state.shape)}")


def pad_dims(q, k, v, state, block_v: int):
    """(q, k, v, state, block_v) with dk zero-padded to a power of two >= 16 and dv to a
    multiple of block_v, itself cut to dv's power of two if larger. Exact: a zero key and query
    component adds nothing to any product, a zero value column's state column stays zero."""
    if block_v & (block_v - 1) or block_v < 16:
        raise ValueError(f"block_v must be a power of two >= 16, got {block_v}")
    dk, dv = q.shape[-1], v.shape[-1]
    block_v = min(block_v, max(16, pow2(dv)))
    pad_k, pad_v = max(16, pow2(dk)) - dk, -dv % block_v
    if pad_k:
        q, k = (jnp.pad(a, ((0, 0),) * 3 + ((0, pad_k),)) for a in (q, k))
    if pad_v:
        v = jnp.pad(v, ((0, 0),) * 3 + ((0, pad_v),))
    if pad_k or pad_v:
        state = jnp.pad(state, ((0, 0), (0, 0), (0, pad_k), (0, pad_v)))
    return q, k, v, state, block_v


def _recurrent_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *,
                      num_tokens: int, keep_states: bool):
    # q_ref, k_ref [T, dk]; v_ref, o_ref [T, bv]; g_ref, beta_ref [T]; s_ref [dk, bv];
    # s_out_ref [T, dk, bv] with keep_states, else [dk, bv].
    s = s_ref[...].astype(jnp.float32)
    for t in range(num_tokens):  # T is small and static: unrolled
        q, k = q_ref[t, :][:, None], k_ref[t, :][:, None]  # [dk, 1]
        decay = jnp.exp(g_ref[t])
        s = s * decay
        delta = (v_ref[t, :] - jnp.sum(s * k, axis=0)) * beta_ref[t]  # [bv]
        s = s + k * delta[None, :]
        o_ref[t, :] = jnp.sum(s * q, axis=0).astype(o_ref.dtype)
        if keep_states:
            s_out_ref[t, :, :] = s
    if not keep_states:
        s_out_ref[...] = s


def gated_delta_recurrent(q, k, v, g, beta, state, *, keep_states: bool = False,
                          block_v: int = DEFAULT_BLOCK_V, num_warps: int = 4,
                          interpret: bool = False):
    """Token-by-token gated delta rule over T tokens per row with a Pallas kernel.

    Args:
      q, k: `[B, T, H, dk]` fp32, normalised (q already scaled); v `[B, T, H, dv]` fp32;
      g, beta: `[B, T, H]` fp32 log-decay and write strength (0 and 0 make a token a no-op);
      state: `[B, H, dk, dv]` fp32 (dk and dv not powers of two are zero-padded: exact).
      keep_states: return the state after every token, `[B, T, H, dk, dv]`, instead of the last.
      block_v: value columns per program, a power of two >= 16 (at most dv rounded up).
      num_warps: Triton launch parameter (ignored in interpret mode).
      interpret: run the Pallas interpreter (required on CPU).

    Returns:
      (out `[B, T, H, dv]` fp32, state).
    """
    batch, tokens, heads, dk = q.shape
    dv = v.shape[-1]
    check_state(state, batch, heads, dk, dv)
    q, k, v, state, block_v = pad_dims(q, k, v, state, block_v)
    dk_pad, dv_pad = q.shape[-1], v.shape[-1]
    heads_first = functools.partial(jnp.moveaxis, source=2, destination=1)
    q, k, v = (heads_first(a.astype(jnp.float32)) for a in (q, k, v))  # [B, H, T, d]
    g, beta = (jnp.swapaxes(a.astype(jnp.float32), 1, 2) for a in (g, beta))  # [B, H, T]
    tok = pl.BlockSpec((None, None, tokens, dk_pad), lambda b, h, j: (b, h, 0, 0))
    col = pl.BlockSpec((None, None, tokens, block_v), lambda b, h, j: (b, h, 0, j))
    scalar = pl.BlockSpec((None, None, tokens), lambda b, h, j: (b, h, 0))
    s_spec = pl.BlockSpec((None, None, dk_pad, block_v), lambda b, h, j: (b, h, 0, j))
    if keep_states:
        s_out_spec = pl.BlockSpec((None, None, tokens, dk_pad, block_v),
                                  lambda b, h, j: (b, h, 0, 0, j))
        s_out_shape = (batch, heads, tokens, dk_pad, dv_pad)
    else:
        s_out_spec, s_out_shape = s_spec, (batch, heads, dk_pad, dv_pad)
    out, s_out = pl.pallas_call(
        functools.partial(_recurrent_kernel, num_tokens=tokens, keep_states=keep_states),
        grid=(batch, heads, dv_pad // block_v),
        in_specs=[tok, tok, col, scalar, scalar, s_spec],
        out_specs=[col, s_out_spec],
        out_shape=[jax.ShapeDtypeStruct((batch, heads, tokens, dv_pad), jnp.float32),
                   jax.ShapeDtypeStruct(s_out_shape, jnp.float32)],
        input_output_aliases={} if keep_states else {5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="gated_delta_recurrent",
    )(q, k, v, g, beta, state.astype(jnp.float32))
    out = jnp.moveaxis(out, 1, 2)[..., :dv]
    return out, (jnp.moveaxis(s_out, 1, 2) if keep_states else s_out)[..., :dk, :dv]
