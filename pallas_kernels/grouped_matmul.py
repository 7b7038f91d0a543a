"""Pallas (Triton backend) grouped matmul: each row times the weight of the expert it is routed
to, reading only the experts that have rows.

`grouped_matmul(lhs, w, group_sizes)` is, for rows sorted by expert (expert e owns the
`group_sizes[e]` rows after those of experts < e), `out[m] = lhs[m] @ w[e(m)].T`: lhs [M, K],
w [E, N, K] (nn.Linear's layout per expert) -> [M, N] in lhs's dtype, accumulated in fp32. With
`w_up` it is an MoE expert's fused SwiGLU, `silu(lhs @ w.T) * (lhs @ w_up.T)`; with `row_ids`
the rows are gathered in the kernel (`lhs[row_ids[m]]`: a token's hidden state read where it
lies, not copied once per expert). Weights may be quantized as `ninfer_jax.quant` holds them
(`QArray`s: int8/int4 group-wise, FP8 in 128 x 128 blocks) and are dequantized tile by tile in
registers (`quant_matmul`'s scheme; int4 meets activations whose every group is permuted to
even channels then odd ones, done here before the call). `layer` selects one layer of weights
stacked [L, E, N, K] inside the kernel, so a scanned layer loop hands over its stacked buffer
as it is (a slice of it would be copied before a kernel could read it). The jnp oracle is
`grouped_matmul_reference`.

Shape of the computation (the tiling of vLLM's fused-MoE kernel and megablox's gmm, rebuilt
here): rows are cut into tiles of `block_m` that never straddle two experts (each expert's rows
start a new tile), at most `cdiv(M, block_m) + min(E, M)` tiles, and an expert without rows has
no tile, so its weights are never read. The grid is (tiles, N / block_n). A program reads its
tile's (expert, first row, row end) from a table computed in XLA (`tile_table`), loops over K
in `block_k` steps (one quantization group), loads the [block_n, block_k] tile of its expert's
weight, and stores only its own rows (masked; a partial tile's other rows belong to the next
expert's tile). Programs past the last tile load and store nothing. Decode-sized inputs (M =
B x top-k rows) so read each selected expert's weights once, and no other. On CPU it runs only
with `interpret=True`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.quant_matmul import FP8_BLOCK, MIN_BLOCK
from pallas_kernels.target import gpu_limits

_PRECISION = lax.Precision.HIGHEST  # fp32 operands stay IEEE (Triton's default is TF32)


def _fields(w) -> tuple[jax.Array, jax.Array | None, str | None, int]:
    """(values, scales or None, method or None, group along K) of an array or a `QArray`."""
    if hasattr(w, "dequantize"):
        return w.q, w.scale, w.method, FP8_BLOCK if w.method == "fp8" else w.block[1]
    return w, None, None, 0


def _shape(w) -> tuple[int, ...]:
    return tuple(w.shape)


def grouped_matmul_reference(lhs: jax.Array, w, group_sizes: jax.Array, *, w_up=None,
                             row_ids: jax.Array | None = None, layer: jax.Array | None = None,
                             expert_offset: jax.Array | None = None) -> jax.Array:
    """The oracle: each row's expert weight gathered and applied densely (fp32 products, IEEE),
    the result cast to lhs's dtype. Arguments as `grouped_matmul`'s."""
    if layer is not None:
        w = w[layer[0]]
        w_up = None if w_up is None else w_up[layer[0]]
    x = (lhs if row_ids is None else lhs[row_ids]).astype(jnp.float32)
    num_local = _shape(w)[0]
    offset = 0 if expert_offset is None else expert_offset.reshape(())
    expert = jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(x.shape[0]), side="right")
    local = expert - offset
    mine = (local >= 0) & (local < num_local)
    local = jnp.clip(local, 0, num_local - 1)

    def apply(weight):
        full = weight.dequantize(jnp.float32) if hasattr(weight, "dequantize") else weight
        return jnp.einsum("mk,mnk->mn", x, full.astype(jnp.float32)[local],
                          precision=_PRECISION)

    out = apply(w)
    if w_up is not None:
        out = jax.nn.silu(out) * apply(w_up)
    return jnp.where(mine[:, None], out, 0).astype(lhs.dtype)


def num_tiles(num_rows: int, num_experts: int, block_m: int) -> int:
    """The most tiles `num_rows` sorted rows can need (each expert's rows start a tile)."""
    return pl.cdiv(num_rows, block_m) + min(num_experts, num_rows)


def tile_table(group_sizes: jax.Array, num_rows: int, block_m: int,
               expert_offset: jax.Array | None = None, num_local: int | None = None
               ) -> jax.Array:
    """[num_tiles, 3] int32 (expert, first row, row end) of the tiles of `block_m` rows that
    never straddle two experts; entries past the last tile have no rows (first == end == 0).
    With `expert_offset`, only the `num_local` experts from it have tiles (their expert index
    counted from it): the rows of the others are another device's."""
    sizes = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(sizes) - sizes
    if expert_offset is not None:
        offset = expert_offset.reshape(()).astype(jnp.int32)
        sizes = lax.dynamic_slice_in_dim(sizes, offset, num_local)
        starts = lax.dynamic_slice_in_dim(starts, offset, num_local)
    num_experts = sizes.shape[0]
    tiles = (sizes + block_m - 1) // block_m
    tile_end = jnp.cumsum(tiles)
    t = jnp.arange(num_tiles(num_rows, num_experts, block_m), dtype=jnp.int32)
    expert = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), num_experts - 1)
    first = starts[expert] + (t - (tile_end[expert] - tiles[expert])) * block_m
    end = jnp.minimum(first + block_m, starts[expert] + sizes[expert])
    used = t < tile_end[-1]
    return jnp.stack([expert, jnp.where(used, first, 0), jnp.where(used, end, 0)],
                     axis=1).astype(jnp.int32)


def _product(xs: list[jax.Array], w_ref, s_ref, at: tuple, cols, k, *, method: str | None,
             block_k: int) -> jax.Array:
    """The activations' [block_m, block_k] tile at input offset k (`xs`: whole, or for int4 its
    two halves) times one expert's [block_n, block_k] weight tile there, transposed: [block_m,
    block_n] fp32. A quantized tile is dequantized in fp32 into the activations' dtype; int4 as
    its low nibbles against the first (even-channel) half and its high nibbles against the
    second (the order the caller permuted the activations to)."""
    x = xs[0]
    dtype = x.dtype

    def dot(a, b):
        return plgpu.dot(a, b, trans_b=True, precision=_PRECISION)

    if method is None:
        return dot(x, w_ref[(*at, cols, pl.ds(k, block_k))].astype(dtype))
    if method == "fp8":  # one scale per 128 x 128 block: block_n <= 128 divides it
        s = s_ref[(*at, cols.start // FP8_BLOCK, k // FP8_BLOCK)].astype(jnp.float32)
    else:
        s = s_ref[(*at, cols, pl.ds(k // block_k, 1))].astype(jnp.float32)  # [block_n, 1]
    if method in ("int8", "fp8"):
        w = w_ref[(*at, cols, pl.ds(k, block_k))].astype(jnp.float32) * s
        return dot(x, w.astype(dtype))
    half = block_k // 2
    p = w_ref[(*at, cols, pl.ds(k // 2, half))].astype(jnp.int32)
    lo = (((p & 15) - 8).astype(jnp.float32) * s).astype(dtype)
    hi = (((p >> 4) - 8).astype(jnp.float32) * s).astype(dtype)
    return dot(xs[0], lo) + dot(xs[1], hi)


def _kernel(table_ref, *refs, num_weights: int, quantized: bool, gathered: bool,
            stacked: bool, initial: bool, method: str | None, block_m: int, block_n: int, block_k: int,
            num_k: int):
    refs = list(refs)
    row_ids_ref = refs.pop(0) if gathered else None
    layer_ref = refs.pop(0) if stacked else None
    lhs_ref, o_ref = refs.pop(0), refs.pop()
    if initial:  # the zeros the output starts as (aliased to it)
        refs.pop()
    per = 2 if quantized else 1
    weights = [(refs[i], refs[i + 1] if quantized else None)
               for i in range(0, num_weights * per, per)]
    j = pl.program_id(1)
    expert, first, end = table_ref[0], table_ref[1], table_ref[2]
    rows = first + lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    real = (rows < end)[:, None]  # [block_m, 1]
    at = (expert,) if layer_ref is None else (layer_ref[0], expert)
    cols = pl.ds(pl.multiple_of(j * block_n, block_n), block_n)
    dtype = lhs_ref.dtype
    if gathered:  # each row's token, read where it lies
        source = row_ids_ref[jnp.minimum(rows, row_ids_ref.shape[0] - 1)][:, None]

    def load(k, width):  # the rows' activations [block_m, width] at input offset k
        if gathered:
            x = lhs_ref[jnp.broadcast_to(source, (block_m, width)),
                        k + lax.broadcasted_iota(jnp.int32, (block_m, width), 1)]
        else:
            x = plgpu.load(lhs_ref.at[pl.ds(first, block_m), pl.ds(k, width)],
                           mask=jnp.broadcast_to(real, (block_m, width)), other=0)
        return x.astype(dtype)

    def body(step, accs):
        k = pl.multiple_of(step * block_k, block_k)
        half = block_k // 2
        xs = [load(k, half), load(k + half, half)] if method == "int4" else [load(k, block_k)]
        return tuple(acc + _product(xs, w_ref, s_ref, at, cols, k, method=method,
                                    block_k=block_k)
                     for acc, (w_ref, s_ref) in zip(accs, weights))

    zeros = tuple(jnp.zeros((block_m, block_n), jnp.float32) for _ in weights)
    steps = (end > first).astype(jnp.int32) * num_k  # (a where on scalars lowers to i1)
    accs = lax.fori_loop(jnp.int32(0), steps, body, zeros)
    out = accs[0] if len(accs) == 1 else jax.nn.silu(accs[0]) * accs[1]
    plgpu.store(o_ref.at[pl.ds(first, block_m), cols], out.astype(o_ref.dtype),
                mask=jnp.broadcast_to(real, (block_m, block_n)))


def _pow2_divisor(n: int, cap: int) -> int | None:
    """The largest power of two in [MIN_BLOCK, cap] dividing n, or None."""
    b = cap
    while b >= MIN_BLOCK:
        if n % b == 0:
            return b
        b //= 2
    return None


def supports(n: int, k: int, method: str | None = None, group: int = 0) -> bool:
    """Whether the kernel takes a weight [.., N, K] so quantized: N and K divisible by 16
    (the smallest Triton dot), a quantized weight's group a power of two >= 16 (FP8: its
    128 x 128 blocks, N divisible by 128)."""
    if method == "fp8":
        return n % FP8_BLOCK == 0 and k % FP8_BLOCK == 0
    if method is not None:
        return (_pow2_divisor(group, group) == group and k % group == 0
                and _pow2_divisor(n, 128) is not None)
    return _pow2_divisor(n, 128) is not None and _pow2_divisor(k, 64) is not None


def block_sizes(num_rows: int, n: int, k: int, num_experts: int, dtype, method: str | None,
                group: int, num_weights: int) -> tuple[int, int, int]:
    """(block_m, block_n, block_k): rows per tile from the rows an expert gets on average (16
    for decode-sized inputs, up to 64); column blocks dividing N of up to 128 (64 for
    decode-sized inputs: more programs to spread a few experts' weights over the SMs); K in
    steps of one quantization group (float weights: up to 64); the column block halved until
    the tiles the pipeline stages hold fit the target's shared memory."""
    per_expert = max(1, num_rows // max(num_experts, 1))
    block_m = MIN_BLOCK
    while block_m * 2 <= min(per_expert, 64):
        block_m *= 2
    cap = FP8_BLOCK if method == "fp8" else 128
    block_n = _pow2_divisor(n, min(cap, 64 if per_expert < MIN_BLOCK else 128))
    block_k = group if method is not None else _pow2_divisor(k, 64)
    itemsize = jnp.dtype(dtype).itemsize
    limits = gpu_limits()
    stages = 2
    while True:
        tiles = stages * itemsize * (block_m * block_k + num_weights * block_n * block_k)
        if limits.fits(tiles + num_weights * block_m * block_n * 4) or block_n == MIN_BLOCK:
            return block_m, block_n, block_k
        block_n //= 2


def grouped_matmul(lhs: jax.Array, w, group_sizes: jax.Array, *, w_up=None,
                   row_ids: jax.Array | None = None, layer: jax.Array | None = None,
                   expert_offset: jax.Array | None = None, num_rows: int | None = None, block_m: int | None = None,
                   block_n: int | None = None, num_warps: int = 4, num_stages: int = 2,
                   interpret: bool = False) -> jax.Array:
    """Rows sorted by expert times their expert's weight, with the Pallas kernel.

    Args:
      lhs: [R, K] activations (bf16 on GPU; fp32 keeps IEEE products); with `row_ids`, the
        rows they index (e.g. the tokens), else the M sorted rows themselves.
      w: [E, N, K] expert weights ([L, E, N, K] with `layer`), an array or a `QArray`.
      group_sizes: [E] int32 rows per expert, summing to M (all experts', with
        `expert_offset`).
      w_up: the up-projection beside `w` (the gate) for a fused SwiGLU, same layout.
      row_ids: [M] int32, the lhs row of each sorted row (None: lhs is the sorted rows).
      layer: [1] int32, the layer of stacked weights.
      expert_offset: [1] int32: `w` holds the experts from this one on (a device's share of
        experts split over a mesh); the other experts' rows come back as zeros.
      num_rows: M (default: row_ids' or lhs' length).
      block_m, block_n: tile sizes (default `block_sizes`); powers of two >= 16, block_n <= 128
        and dividing N (FP8: dividing 128).
      num_warps, num_stages: Triton launch parameters (ignored in interpret mode).
      interpret: run the Pallas interpreter (required on CPU).

    Returns:
      [M, N] in lhs's dtype.
    """
    _, _, method, group = _fields(w)
    stacked = layer is not None
    *lead, num_experts, n, k = _shape(w)
    if len(lead) != int(stacked) or lhs.shape[1] != k or lhs.ndim != 2:
        raise ValueError(f"w must be [{'L, ' if stacked else ''}E, N, K] with K = lhs's "
                         f"{lhs.shape[-1]}; got w {_shape(w)}, lhs {lhs.shape}")
    if expert_offset is None and group_sizes.shape != (num_experts,):
        raise ValueError(f"group_sizes must be [E={num_experts}], got {group_sizes.shape}")
    if w_up is not None and (_shape(w_up) != _shape(w) or _fields(w_up)[2] != method):
        raise ValueError(f"w_up must be held as w is, {_shape(w)} {method}; got "
                         f"{_shape(w_up)} {_fields(w_up)[2]}")
    m = num_rows or (row_ids.shape[0] if row_ids is not None else lhs.shape[0])
    if not supports(n, k, method, group):
        raise ValueError(f"the kernel needs N ({n}) and K ({k}) divisible by {MIN_BLOCK} "
                         f"(a quantized weight: K by its power-of-two group {group}; FP8: "
                         f"N and K by {FP8_BLOCK})")
    if m == 0:
        return jnp.zeros((0, n), lhs.dtype)
    weights = [w] if w_up is None else [w, w_up]
    auto_m, auto_n, block_k = block_sizes(m, n, k, num_experts, lhs.dtype, method, group,
                                          len(weights))
    block_m, block_n = block_m or auto_m, block_n or auto_n
    cap = FP8_BLOCK if method == "fp8" else 128
    if n % block_n or block_n > cap or block_n < MIN_BLOCK or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two in {MIN_BLOCK}..{cap} dividing N "
                         f"({n}), got {block_n}")
    if method == "int4":  # each group's even channels, then its odd ones (the nibble order)
        rows_in = lhs.shape[0]
        lhs = lhs.reshape(rows_in, k // group, group // 2, 2).swapaxes(-1, -2).reshape(
            rows_in, k)
    table = tile_table(group_sizes, m, block_m, expert_offset, num_experts)
    tiles = table.shape[0]
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, j, nd=a.ndim: (0,) * nd)
    operands, specs = [table], [pl.BlockSpec((None, 3), lambda t, j: (t, 0))]
    if row_ids is not None:
        ids = row_ids.astype(jnp.int32)
        operands.append(ids)
        specs.append(whole(ids))
    if stacked:
        operands.append(layer.astype(jnp.int32).reshape(1))
        specs.append(whole(operands[-1]))
    operands.append(lhs)
    specs.append(whole(lhs))
    for weight in weights:
        v, s, _, _ = _fields(weight)
        operands += [v] if s is None else [v, s.astype(jnp.float32)]
        specs += [whole(v)] if s is None else [whole(v), whole(s)]
    aliases = {}
    if expert_offset is not None:  # rows the kernel does not write are zeros
        aliases = {len(operands): 0}
        operands.append(jnp.zeros((m, n), lhs.dtype))
        specs.append(pl.BlockSpec((m, n), lambda t, j: (0, 0)))
    kernel = functools.partial(
        _kernel, num_weights=len(weights), quantized=method is not None,
        gathered=row_ids is not None, stacked=stacked, initial=bool(aliases), method=method, block_m=block_m,
        block_n=block_n, block_k=block_k, num_k=k // block_k)
    return pl.pallas_call(
        kernel,
        grid=(tiles, n // block_n),
        in_specs=specs,
        out_specs=pl.BlockSpec((m, n), lambda t, j: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_matmul" if w_up is None else "grouped_swiglu",
    )(*operands)
