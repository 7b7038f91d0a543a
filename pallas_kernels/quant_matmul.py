"""Pallas (Triton backend) matmul with a group-quantized weight: the dequantize fused into the
weight operand's read.

`quant_matmul(x, q, scale, method=, group=)` is `x @ dequantize(q, scale).T` for x [M, K] and a
weight [N, K] held as int8 values (`method="int8"`, q [N, K]) or packed int4 (`"int4"`, q
[N, K / 2] uint8: byte j of a row holds channel 2j in its low nibble and 2j + 1 in its high
one, each as value + 8), with one fp32 scale per `group` input channels of a row (scale
[N, K / group]), or FP8 (`"fp8"`, q [N, K] float8_e4m3fn with one fp32 scale per 128 x 128
block, scale [N / 128, K / 128]: the official fine-grained checkpoints' layout). FP8 weights
are dequantized to the activations' dtype tile by tile, or with `fp8_activations` (Hopper-class
GPUs, compute capability 9.0+: the checkpoints' "activation_scheme": "dynamic") the matmul runs
FP8 x FP8: each row's 128-channel activation tile is quantized to e4m3 with its own scale
(amax / 448) in the kernel, the tensor-core dot accumulates in fp32, and the two block scales
multiply the partial sum. `quant_matmul_reference` (with the same `fp8_activations`) is the
jnp oracle (the
dequantized weight, then one dot). The kernel reads each weight byte once: the grid is
(M / block_m, N / block_n); each program loops over the K groups, loads its [block_n, group]
tile of values (int4: the low and the high nibbles of one [block_n, group / 2] byte tile, the
even and the odd channels of the group, met by the activations permuted to that order before
the call: a copy of x, not of the weight), multiplies by
the tile's scales in fp32 and accumulates `x_tile @ w_tile^T` in fp32 (Triton's dot needs 16+
rows: M is padded to block_m >= 16). On CPU it runs only with `interpret=True`.

Shapes the kernel takes (`kernel_supports`): group a power of two >= 16, N divisible by a
power-of-two block_n >= 16 (fp8: group 128 and N divisible by 128, one scale row a program);
callers fall back to the reference elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

METHODS = ("int8", "int4", "fp8")
FP8_BLOCK = 128
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
MIN_BLOCK = 16  # Triton's tl.dot needs 16+ rows and columns
MAX_BLOCK_N = 128
_PRECISION = lax.Precision.HIGHEST  # fp32 operands stay IEEE (Triton's default is TF32)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _check(x: jax.Array, q: jax.Array, scale: jax.Array, method: str, group: int) -> None:
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if x.ndim != 2 or q.ndim != 2 or scale.ndim != 2:
        raise ValueError(f"x, q and scale must be 2-D, got {x.shape}, {q.shape}, {scale.shape}")
    m, k = x.shape
    n = q.shape[0]
    want_q = (n, k // 2) if method == "int4" else (n, k)
    rows = -(-n // FP8_BLOCK) if method == "fp8" else n
    if k % group or q.shape != want_q or scale.shape != (rows, k // group):
        raise ValueError(f"for x [{m}, {k}] and group {group}, {method} q must be {want_q} and "
                         f"scale {(rows, k // group)}; got q {q.shape}, scale {scale.shape}")


def quantize_activations(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., 128] -> (e4m3 values, fp32 scales [..., 1]): amax / 448 per 128-channel tile
    (a zero tile: scale 0, values 0)."""
    xf = x.astype(jnp.float32)
    s = jnp.max(jnp.abs(xf), axis=-1, keepdims=True) / FP8_MAX
    return (xf / jnp.where(s > 0, s, 1.0)).astype(jnp.float8_e4m3fn), s


def quant_matmul_reference(x: jax.Array, q: jax.Array, scale: jax.Array, *, method: str,
                           group: int, fp8_activations: bool = False) -> jax.Array:
    """x [M, K] @ dequantize(q, scale)^T -> [M, N] fp32 (the kernel's oracle)."""
    _check(x, q, scale, method, group)
    n, k = q.shape[0], x.shape[1]
    if method == "fp8":
        s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), FP8_BLOCK, axis=0)[:n], group, 1)
        w = q.astype(jnp.float32) * s
        if fp8_activations:
            xq, xs = quantize_activations(x.reshape(x.shape[0], k // group, group))
            # XLA:GPU drops an f32 -> e4m3 -> f32 round trip (excess precision allowed): on
            # the H200 the oracle took unquantized activations, 2% off the kernel. The
            # barrier keeps the e4m3 values (seen in the sm_90 compiled HLO).
            xq = lax.optimization_barrier(xq)
            x = (xq.astype(jnp.float32) * xs).reshape(x.shape[0], k)
        return jnp.dot(x.astype(jnp.float32), w.T, precision=_PRECISION,
                       preferred_element_type=jnp.float32)
    if method == "int8":
        w = q.astype(jnp.float32).reshape(n, k // group, group)
    else:
        w = jnp.stack([q & 15, q >> 4], axis=-1).astype(jnp.float32) - 8.0
        w = w.reshape(n, k // group, group)
    w = (w * scale.astype(jnp.float32)[..., None]).reshape(n, k)
    return jnp.dot(x.astype(jnp.float32), w.T, precision=_PRECISION,
                   preferred_element_type=jnp.float32)


def block_n_for(n: int) -> int | None:
    """The largest power-of-two block of rows (16..128) dividing N, or None."""
    b = MAX_BLOCK_N
    while b >= MIN_BLOCK:
        if n % b == 0:
            return b
        b //= 2
    return None


def kernel_supports(n: int, group: int, method: str = "int8") -> bool:
    if method == "fp8":
        return group == FP8_BLOCK and n % FP8_BLOCK == 0
    return _is_pow2(group) and group >= MIN_BLOCK and block_n_for(n) is not None


def _kernel(x_ref, *refs, method: str, group: int, num_groups: int, fp8_activations: bool,
            stacked: bool):
    # x_ref [block_m, K]; (stacked: layer_ref [1]); q_ref [(L,) block_n, K or K / 2]; s_ref
    # [(L,) block_n or 1 (fp8), K / group]
    layer_ref, q_ref, s_ref, o_ref = refs if stacked else (None, *refs)
    at = (slice(None),) if layer_ref is None else (layer_ref[0], slice(None))
    block_m, block_n = o_ref.shape
    dtype = x_ref.dtype

    def tile(i, width, offset):
        return x_ref[:, pl.ds(i * group + offset, width)]

    def body(i, acc):
        s = s_ref[(*at, pl.ds(i, 1))].astype(jnp.float32)  # [block_n, 1] ([1, 1]: fp8's)
        if fp8_activations:  # FP8 x FP8 on the tensor cores, both block scales after the dot
            xq, xs = quantize_activations(tile(i, group, 0))  # [block_m, g], [block_m, 1]
            part = plgpu.dot(xq, q_ref[(*at, pl.ds(i * group, group))], trans_b=True)
            return acc + part * xs * s
        if method in ("int8", "fp8"):
            w = (q_ref[(*at, pl.ds(i * group, group))].astype(jnp.float32) * s).astype(dtype)
            return acc + plgpu.dot(tile(i, group, 0), w, trans_b=True, precision=_PRECISION)
        half = group // 2
        p = q_ref[(*at, pl.ds(i * half, half))].astype(jnp.int32)
        lo = (((p & 15) - 8).astype(jnp.float32) * s).astype(dtype)
        hi = (((p >> 4) - 8).astype(jnp.float32) * s).astype(dtype)
        acc = acc + plgpu.dot(tile(i, half, 0), lo, trans_b=True, precision=_PRECISION)
        return acc + plgpu.dot(tile(i, half, half), hi, trans_b=True, precision=_PRECISION)

    acc = lax.fori_loop(0, num_groups, body, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def quant_matmul(x: jax.Array, q: jax.Array, scale: jax.Array, *, method: str, group: int,
                 fp8_activations: bool = False, layer: jax.Array | None = None,
                 block_m: int | None = None, num_warps: int = 4, num_stages: int = 2,
                 interpret: bool = False) -> jax.Array:
    """x [M, K] @ dequantize(q, scale)^T -> [M, N] fp32 with the Pallas kernel.

    Args:
      x: [M, K] activations (bf16 on GPU; fp32 keeps IEEE products).
      q, scale, method, group: the weight, as in the module docstring.
      fp8_activations: with method="fp8", FP8 x FP8 products (see the module docstring).
      layer: [1] int32 with q and scale stacked [L, ...] (a scanned layer loop's buffers):
        the kernel reads that layer in place (a slice would be copied before the call).
      block_m: rows per program, a power of two >= 16 (default: M rounded up, at most 64).
      num_warps, num_stages: Triton launch parameters (ignored in interpret mode).
      interpret: run the Pallas interpreter (required on CPU).
    """
    if fp8_activations and method != "fp8":
        raise ValueError(f"fp8_activations is for method 'fp8', got {method!r}")
    stacked = layer is not None
    if stacked and (q.ndim != 3 or scale.ndim != 3):
        raise ValueError(f"with layer, q and scale must be stacked [L, ...], got {q.shape}, "
                         f"{scale.shape}")
    _check(x, q[0] if stacked else q, scale[0] if stacked else scale, method, group)
    m, k = x.shape
    n = q.shape[-2]
    if not kernel_supports(n, group, method):
        raise ValueError(f"the kernel needs a power-of-two group >= {MIN_BLOCK} and N "
                         f"divisible by a power of two >= {MIN_BLOCK} (fp8: 128 and 128); got "
                         f"group {group}, N {n}")
    block_n = FP8_BLOCK if method == "fp8" else block_n_for(n)
    scale_rows = 1 if method == "fp8" else block_n
    if block_m is None:
        block_m = min(64, max(MIN_BLOCK, pl.next_power_of_2(m)))
    if not _is_pow2(block_m) or block_m < MIN_BLOCK:
        raise ValueError(f"block_m must be a power of two >= {MIN_BLOCK}, got {block_m}")
    rows = pl.cdiv(m, block_m) * block_m
    xp = jnp.pad(x, ((0, rows - m), (0, 0)))
    if method == "int4":  # each group's even channels, then its odd ones (the nibble order)
        xp = xp.reshape(rows, k // group, group // 2, 2).swapaxes(-1, -2).reshape(rows, k)
    kernel = functools.partial(_kernel, method=method, group=group, num_groups=k // group,
                               fp8_activations=fp8_activations, stacked=stacked)
    lead = q.shape[:1] if stacked else ()  # every layer of a stack: the kernel indexes one
    operands = [xp, *([layer.astype(jnp.int32).reshape(1)] if stacked else []), q,
                scale.astype(jnp.float32)]
    specs = [pl.BlockSpec((block_m, k), lambda i, j: (i, 0)),
             *([pl.BlockSpec((1,), lambda i, j: (0,))] if stacked else []),
             pl.BlockSpec((*lead, block_n, q.shape[-1]), lambda i, j: (*(0,) * len(lead), j, 0)),
             pl.BlockSpec((*lead, scale_rows, k // group),
                          lambda i, j: (*(0,) * len(lead), j, 0))]
    out = pl.pallas_call(
        kernel,
        grid=(rows // block_m, n // block_n),
        in_specs=specs,
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((rows, n), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"quant_matmul_{method}",
    )(*operands)
    return out[:m]
