"""Pallas (Triton backend) chunked gated delta rule: GDN prefill.

Owns the GDN recurrence over a prefill chunk, condensed per sub-chunk of `c` tokens into
matmuls (the UT transform): with `cum` the running sum of g inside the sub-chunk,
`D[i, j] = exp(cum_i - cum_j)` for `j <= i`, `kb = beta * k`,
`T = (I + strictly_lower(kb k^T * D))^-1`, the corrected values `u = T (beta v) - T (kb e^cum) S`,
the outputs `(q e^cum) S + lower(q k^T * D) u` and the state
`S e^cum_last + (k e^(cum_last - cum))^T u`. Same contract as `ninfer_jax.models.qwen3_6.gdn.
chunked_delta_rule` (and `recurrent_delta_rule`), its oracles.

Shape of the computation. The state's value columns are independent, so the grid is
`(B, H, dv / block_v)`; a program keeps `[dk, block_v]` of one head's state in registers and runs
the sub-chunks in order (`fori_loop`), reading the tokens once. T's inverse is computed in the
kernel by forward substitution over the sub-chunk's rows (row r of the inverse from the rows above
it), with masks in place of dynamic row indexing; the cumulative sums are masked row sums. Only
the `[c, c]` and `[c, dk]` terms are recomputed by each of the dv / block_v programs of a head.

Compile time: the substitution's c - 1 updates of the whole [c, c] block are what ptxas spends
its time on, and it grows with each thread's share of that block. At the 27B's dims (48 heads,
128 x 128 state, c = 64) and 4 warps sm_90 compiled one prefill shape in 23 s; with c / 4 warps
(16 at c = 64) in 4.7 s (c = 32: 2.7 s with 8 warps; c = 16: 1.6 s with 4), so that is the
default. Forming the inverse as (I + a)(I + a^2)(I + a^4)... instead (log2 c pairs of fp32 [c, c]
dots) took 125 s.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gdn.recurrent import DEFAULT_BLOCK_V, check_state, pad_dims

_PRECISION = lax.Precision.HIGHEST  # IEEE fp32 (Triton's default for fp32 is TF32)


def _dot(a, b, **kw):
    return plgpu.dot(a, b, precision=_PRECISION, **kw)


def _chunked_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *,
                    chunk: int, num_chunks: int):
    # q_ref, k_ref [Tp, dk]; v_ref, o_ref [Tp, bv]; g_ref, beta_ref [Tp]; s_ref, s_out_ref
    # [dk, bv].
    c = chunk
    row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    colm = lax.broadcasted_iota(jnp.int32, (c, c), 1)
    lower, strict = colm <= row, colm < row
    eye = jnp.where(row == colm, 1.0, 0.0)

    def body(n, s):
        span = pl.ds(n * c, c)
        q, k, v = q_ref[span, :], k_ref[span, :], v_ref[span, :]
        g, beta = g_ref[span], beta_ref[span]
        cum = jnp.sum(jnp.where(lower, g[None, :], 0.0), axis=1)  # [c] running sum of g
        cum_last = jnp.sum(g)
        decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[:, None] - cum[None, :], 0.0)), 0.0)
        kb = k * beta[:, None]
        a = jnp.where(strict, -_dot(kb, k, trans_b=True) * decay, 0.0)  # T = (I - a)^-1

        def substitute(r, m):  # row r of (I - a)^-1 - I from the rows above it
            at_r = row == r
            m_r = jnp.sum(jnp.where(at_r, m, 0.0), axis=0)  # [c]
            m_r = m_r + jnp.sum(m_r[:, None] * m, axis=0)
            return jnp.where(at_r, m_r[None, :], m)

        t = lax.fori_loop(1, c, substitute, a) + eye
        e_cum = jnp.exp(cum)[:, None]
        u = _dot(t, v * beta[:, None]) - _dot(_dot(t, kb * e_cum), s)  # [c, bv]
        intra = jnp.where(lower, _dot(q, k, trans_b=True) * decay, 0.0)
        o_ref[span, :] = _dot(q * e_cum, s) + _dot(intra, u)
        k_dec = k * jnp.exp(cum_last - cum)[:, None]
        return s * jnp.exp(cum_last) + _dot(k_dec, u, trans_a=True)

    s_out_ref[...] = lax.fori_loop(0, num_chunks, body, s_ref[...].astype(jnp.float32))


def gated_delta_chunked(q, k, v, g, beta, state, *, chunk_size: int = 64,
                        block_v: int = DEFAULT_BLOCK_V, num_warps: int | None = None,
                        interpret: bool = False):
    """Chunked gated delta rule over T tokens per row with a Pallas kernel.

    Args:
      q, k: `[B, T, H, dk]` fp32, normalised (q already scaled); v `[B, T, H, dv]` fp32;
      g, beta: `[B, T, H]` fp32 (a padding token has g = beta = 0: it leaves the state as is);
      state: `[B, H, dk, dv]` fp32 (dk and dv not powers of two are zero-padded: exact).
      chunk_size: tokens per sub-chunk, a power of two >= 16 (T is padded to a multiple).
      block_v: value columns per program, a power of two >= 16 (at most dv rounded up).
      num_warps: Triton launch parameter (ignored in interpret mode); default chunk_size / 4
        (at least 4), see the module docstring.
      interpret: run the Pallas interpreter (required on CPU).

    Returns:
      (out `[B, T, H, dv]` fp32, final state `[B, H, dk, dv]` fp32).
    """
    batch, tokens, heads, dk = q.shape
    dv = v.shape[-1]
    check_state(state, batch, heads, dk, dv)
    if chunk_size & (chunk_size - 1) or chunk_size < 16:
        raise ValueError(f"chunk_size must be a power of two >= 16, got {chunk_size}")
    q, k, v, state, block_v = pad_dims(q, k, v, state, block_v)
    dk_pad, dv_pad = q.shape[-1], v.shape[-1]
    pad = (-tokens) % chunk_size
    padded = tokens + pad

    def heads_first(a):  # [B, T, H, ...] -> [B, H, Tp, ...], padding tokens zero
        a = jnp.pad(a.astype(jnp.float32), ((0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 2))
        return jnp.moveaxis(a, 2, 1)

    tok = pl.BlockSpec((None, None, padded, dk_pad), lambda b, h, j: (b, h, 0, 0))
    col = pl.BlockSpec((None, None, padded, block_v), lambda b, h, j: (b, h, 0, j))
    scalar = pl.BlockSpec((None, None, padded), lambda b, h, j: (b, h, 0))
    s_spec = pl.BlockSpec((None, None, dk_pad, block_v), lambda b, h, j: (b, h, 0, j))
    out, s_out = pl.pallas_call(
        functools.partial(_chunked_kernel, chunk=chunk_size, num_chunks=padded // chunk_size),
        grid=(batch, heads, dv_pad // block_v),
        in_specs=[tok, tok, col, scalar, scalar, s_spec],
        out_specs=[col, s_spec],
        out_shape=[jax.ShapeDtypeStruct((batch, heads, padded, dv_pad), jnp.float32),
                   jax.ShapeDtypeStruct((batch, heads, dk_pad, dv_pad), jnp.float32)],
        input_output_aliases={5: 1},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps or max(4, chunk_size // 4),
                                             num_stages=1),
        interpret=interpret,
        name="gated_delta_chunked",
    )(*(heads_first(a) for a in (q, k, v, g, beta)), state.astype(jnp.float32))
    return jnp.moveaxis(out, 1, 2)[:, :tokens, :, :dv], s_out[..., :dk, :dv]
