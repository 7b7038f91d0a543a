"""Stateless building blocks of the family: norms, rotary embedding, SwiGLU MLP and MoE.

Owns the per-token maths of DESIGN §14 that carries no sequence state. Activations are in the
params' dtype; norms, softmaxes and matmul accumulation run in fp32 and are cast back.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from ninfer_jax.models.qwen3_6.config import ModelConfig
from ninfer_jax.quant import QArray, is_quantized, materialize
from pallas_kernels.grouped_matmul import grouped_matmul, supports
from pallas_kernels.platform import TP_AXIS
from pallas_kernels.quant_matmul import FP8_BLOCK, kernel_supports, quant_matmul


def einsum32(subscripts: str, *operands: jax.Array) -> jax.Array:
    """einsum with fp32 accumulation and an fp32 result.

    XLA:CPU has no bf16 x bf16 -> f32 dot, so there the operands are upcast first; on
    accelerators the operands stay in their dtype and only the accumulator is fp32 (decided by
    the platform the step is lowered for, so a CPU host lowering for a GPU gets the GPU's
    form). A quantized weight (`quant.QArray`) is dequantized on the fly into the other
    operand's dtype.
    """
    dtype = next(o.dtype for o in operands if not hasattr(o, "dequantize"))
    operands = tuple(materialize(o, dtype) for o in operands)

    def run(*ops, upcast: bool):
        if upcast:
            ops = tuple(o.astype(jnp.float32) for o in ops)
        return jnp.einsum(subscripts, *ops, preferred_element_type=jnp.float32)

    if all(o.dtype == jnp.float32 for o in operands):
        return run(*operands, upcast=False)
    return jax.lax.platform_dependent(*operands, cpu=functools.partial(run, upcast=True),
                                      default=functools.partial(run, upcast=False))


ROUTED_SCOPE = "routed_experts"  # the name scope of an MoE layer's routed experts
_FEW_ROWS = 64  # below this many rows (and above one) XLA:CPU's matmul is faster as W x^T


def linear32(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] times w [out, in] (nn.Linear's layout): [..., out] in fp32.

    On XLA:CPU this layout reads the weight faster than [in, out] at few rows (MEDIUM decode
    1.13x at B=1, 1.17x at B=8). With 2..63 rows the product is formed as W x^T [out, rows]
    behind an optimization barrier, then transposed (a few rows of activations): left alone,
    layout assignment turns it back into x W^T, which XLA:CPU runs 1.3x slower at 4-32 rows
    (24 MEDIUM MLPs at 4 rows: 59 ms against 79 ms; 1 row and 64+ rows gain nothing). MEDIUM
    decode at B=8 1.26x, a K=3 verify at B=1 1.20x (in-process A/B, same greedy tokens).
    Those are CPU forms, chosen by the platform the step is lowered for; elsewhere it is one
    dot (a quantized weight: the fused-dequantize kernel where it applies, a `LayerOf` one
    reading its layer of the stack in place).
    """
    layer = None
    if isinstance(w, LayerOf):  # a quantized weight of a stack, read in place by the kernel
        w, layer = w.stack, w.index.reshape(1)
    if isinstance(w, QArray) and w.q.ndim == 2 + (layer is not None):
        flat = x.reshape(-1, x.shape[-1])
        one = w if layer is None else w[layer[0]]
        if _fused_dequant(one):
            def accelerator(f):
                return quant_matmul(f, w.q, w.scale, method=w.method, group=w.block[1],
                                    fp8_activations=w.method == "fp8" and _gpu_has(9.0),
                                    layer=layer)
        else:
            def accelerator(f):
                return einsum32("ri,oi->ro", f, one)
        y = jax.lax.platform_dependent(flat, cpu=lambda f: _dequantized_rows(f, one),
                                       default=accelerator)
        return y.reshape(*x.shape[:-1], w.shape[-2])
    w = materialize(w, x.dtype)
    rows = math.prod(x.shape[:-1])
    if not 1 < rows < _FEW_ROWS:
        return einsum32("...i,oi->...o", x, w)

    def few_rows_on_cpu(x, w):
        xt = x.reshape(rows, x.shape[-1]).astype(jnp.float32)
        yt = jax.lax.dot_general(w.astype(jnp.float32), xt, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32)  # [out, rows]
        return jax.lax.optimization_barrier(yt).T.reshape(*x.shape[:-1], w.shape[0])

    return jax.lax.platform_dependent(
        x, w, cpu=few_rows_on_cpu, default=lambda x, w: einsum32("...i,oi->...o", x, w))


_GEMV_ROWS = 8  # up to this many rows a quantized matmul on CPU runs as one GEMV a row


def _dequantized_rows(x: jax.Array, w: QArray) -> jax.Array:
    """x [rows, in] times a quantized w [out, in] on XLA:CPU, fp32. Up to `_GEMV_ROWS` rows,
    one `x_row @ dequantize(w).T` a row (int4: the even / odd channels against the low / high
    nibbles), the form XLA:CPU fused best in trials (the contraction over both operands' last
    dims was slower); more rows (prefill chunks), the dequantized weight and one dot. Still
    slower than fp32 on CPU: see docs/quantization.md, "Quantized weights"."""
    rows = x.shape[0]
    if rows > _GEMV_ROWS:
        return einsum32("ri,oi->ro", x, w.dequantize(jnp.float32))
    xf = x.astype(jnp.float32)
    if w.method != "int4":
        halves = [(xf, w.dequantize(jnp.float32))]
    else:  # the even channels meet the low nibbles, the odd ones the high: no interleave
        out, cols = w.shape
        g = w.block[1]
        scale = w.scale.astype(jnp.float32)[..., None]

        def nibbles(v):
            v = (v.astype(jnp.float32) - 8.0).reshape(out, cols // g, g // 2)
            return (v * scale).reshape(out, cols // 2)

        halves = [(xf[:, 0::2], nibbles(w.q & 15)), (xf[:, 1::2], nibbles(w.q >> 4))]
    return jnp.concatenate([
        sum(jnp.matmul(xh[r:r + 1], wh.T, preferred_element_type=jnp.float32)
            for xh, wh in halves) for r in range(rows)], axis=0)


def _fused_dequant(w: QArray) -> bool:
    """Whether an accelerator runs this quantized matmul as the Pallas kernel that dequantizes
    the weight tile by tile (`pallas_kernels.quant_matmul`): one [out, in] matrix (int8, int4,
    or FP8 in 128 x 128 blocks, the latter on GPUs with FP8 conversions: compute capability
    8.9+, or any when lowering on a host without one; on 9.0+ as FP8 x FP8 products) of a shape
    the kernel takes, not split over a tensor-parallel mesh (the kernel is opaque to XLA's
    partitioner). Elsewhere the weight is dequantized into the dot's operand by XLA, on
    CPU always (`scripts/bench.py --suite=quant` measures what that gives)."""
    mesh = jax.sharding.get_abstract_mesh()
    split = not mesh.empty and TP_AXIS in mesh.axis_names and mesh.shape[TP_AXIS] > 1
    if w.method == "fp8" and (w.block[0] != w.block[1] or not _gpu_has(8.9, default=True)):
        return False
    return (w.q.ndim == 2 and not split
            and kernel_supports(w.shape[0], w.block[1], w.method))


def _gpu_has(capability: float, default: bool = False) -> bool:
    """Whether every GPU has at least this compute capability (`default` with none: a CPU
    host lowering for CUDA). 8.9: FP8 conversions; 9.0 (Hopper): FP8 x FP8 products, which
    `quant_matmul` then runs for FP8 weights (activations quantized per 128-channel tile)."""
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if not gpus:
        return default
    return all(float(getattr(d, "compute_capability", "0")) >= capability for d in gpus)


def embed_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table [V, H] rows at ids [...] -> [..., H]. One id is looked up as a gather of two rows
    (the second dropped): XLA turns a one-index gather into a dynamic slice, which the
    tensor-parallel partitioner serves by gathering a vocabulary-split table whole on every
    device (the 35B-A3B's B = 1 decode step at tp = 8: 970 MB a step), while a gather it splits
    (each device its own rows, then a sum)."""
    if ids.size != 1:
        return table[ids]
    flat = ids.reshape(1)
    return table[jnp.concatenate([flat, flat])][:1].reshape(*ids.shape, table.shape[-1])


def dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., in] times w [out, in] with fp32 accumulation, returned in x's dtype."""
    return linear32(x, w).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + w), in fp32, cast back."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """GatedDeltaNet's output norm: plain `* w` (not zero-centred), then `* silu(gate)`."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = weight * y.astype(x.dtype)
    return (y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def mrope_rows(cfg: ModelConfig) -> np.ndarray:
    """For each of the rotary_dim / 2 frequencies, the MRoPE row (0 temporal, 1 height, 2
    width) whose position turns it: transformers' interleaved layout over `mrope_section`."""
    i = np.arange(cfg.rotary_dim // 2)
    _, h, w = cfg.mrope_section
    return np.where((i % 3 == 1) & (i < 3 * h), 1, np.where((i % 3 == 2) & (i < 3 * w), 2, 0))


def rope_cos_sin(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, rotary_dim] (fp32) for integer positions [B, T], or MRoPE positions
    [3, B, T] (temporal, height, width rows).

    Text positions use the same value in all three MRoPE rows, which is plain RoPE over the
    first `rotary_dim` dims (NeoX halves), so [B, T] positions are that case.
    """
    half = jnp.arange(0, cfg.rotary_dim, 2, dtype=jnp.float32) / cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta**half)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    if positions.ndim == 3:  # [3, B, T, R / 2]: each frequency from its row
        rows = mrope_rows(cfg)
        freqs = jnp.where(rows == 1, freqs[1], jnp.where(rows == 2, freqs[2], freqs[0]))
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Partial NeoX RoPE. x [B, T, H, D]; cos/sin [B, T, R] with R <= D rotated dims."""
    r = cos.shape[-1]
    xf = x.astype(jnp.float32)
    x_rot, x_pass = xf[..., :r], xf[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2 :]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return jnp.concatenate([x_rot * c + rotated * s, x_pass], axis=-1).astype(x.dtype)


def swiglu(p: dict, x: jax.Array) -> jax.Array:
    """Dense SwiGLU: down(silu(gate(x)) * up(x)). p: gate/up [I, H], down [H, I]."""
    return dense(jax.nn.silu(dense(x, p["gate"])) * dense(x, p["up"]), p["down"])


@functools.partial(jax.tree_util.register_dataclass, data_fields=["stack", "index"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LayerOf:
    """Layer `index` of weights stacked [L, ...], not sliced yet. A kernel that reads one layer
    indexes the stack in place (XLA copies a slice before a custom call can read it: for the
    routed experts, every expert of the layer, each step; for a quantized weight, all of it);
    everything else takes `get()`."""

    stack: Any  # a pytree of [L, ...] arrays or QArrays
    index: jax.Array  # [] int32

    def get(self) -> Any:
        return jax.tree.map(lambda a: a[self.index], self.stack, is_leaf=is_quantized)


def layer_params(stacked: dict, index) -> dict:
    """Layer `index` of a stack of layer params: every leaf sliced, but those a Pallas kernel
    reads in place, which stay stacked as `LayerOf`s (XLA copies a slice before a custom call
    reads it): an MoE layer's routed experts (the grouped kernel) and quantized weights (the
    fused-dequantize matmul, `linear32`)."""
    index = jnp.asarray(index, jnp.int32)

    def one(leaf):
        return LayerOf(leaf, index) if isinstance(leaf, QArray) else leaf[index]

    mlp_ = stacked.get("mlp")
    if not (isinstance(mlp_, dict) and "experts" in mlp_):
        return jax.tree.map(one, stacked, is_leaf=is_quantized)
    rest = {**stacked, "mlp": {k: v for k, v in mlp_.items() if k != "experts"}}
    out = jax.tree.map(one, rest, is_leaf=is_quantized)
    out["mlp"]["experts"] = LayerOf(mlp_["experts"], index)
    return out


def _sliced(experts):
    return experts.get() if isinstance(experts, LayerOf) else experts


def moe(p: dict, x: jax.Array, cfg: ModelConfig, sharding: str = "intermediate") -> jax.Array:
    """Sparse MoE with a shared expert. x [..., H].

    Router: softmax over all experts in fp32, top-k, renormalised. Experts are SwiGLU. The
    shared expert is SwiGLU times sigmoid(shared_gate(x)). Weights are [out, in]: router
    [E, H], experts gate/up [E, I, H], down [E, H, I] (or a `LayerOf` their stacks). How the
    routed experts run is decided by the platform the step is lowered for
    (`jax.lax.platform_dependent`): on CPU `experts_on_cpu`, on TPU `experts_grouped` (XLA's
    ragged_dot), on GPUs `experts_kernel` (the Pallas grouped matmul; same sums).
    `sharding`: how a tensor-parallel mesh splits the experts ("intermediate" or "expert",
    `ProgramConfig.moe_sharding`), for the kernel's per-device call.
    """
    shape = x.shape
    xt = x.reshape(-1, shape[-1])
    logits = einsum32("nh,eh->ne", xt, p["router"])
    probs = jax.nn.softmax(logits, axis=-1)
    top_w, top_i = jax.lax.top_k(probs, cfg.num_experts_per_tok)
    top_w = (top_w / jnp.sum(top_w, axis=-1, keepdims=True)).astype(x.dtype)
    with jax.named_scope(ROUTED_SCOPE):  # `program.hlo.expert_by_token` reads under it
        routed = jax.lax.platform_dependent(
            p["experts"], xt, top_i, top_w,
            cpu=lambda ex, *a: experts_on_cpu(_sliced(ex), *a),
            tpu=lambda ex, *a: experts_grouped(_sliced(ex), *a),
            default=functools.partial(experts_kernel, sharding=sharding))
    shared = swiglu(p["shared"], xt) * jax.nn.sigmoid(dense(xt, p["shared_gate"]))
    return (routed + shared).reshape(shape)


def experts_on_cpu(ex: dict, xt: jax.Array, top_i: jax.Array, top_w: jax.Array) -> jax.Array:
    """The routed experts as XLA:CPU runs them fastest (it expands `ragged_dot` densely). With
    few tokens (N * k < E) the selected experts' weights are gathered per token (decode reads
    only k experts); with more, every expert runs densely on every token and a [N, E] combine
    matrix with zeros for the unselected experts mixes them."""
    n, k = top_i.shape
    e = ex["gate"].shape[0]
    if n * k < e:
        gate = einsum32("nh,nkih->nki", xt, ex["gate"][top_i])
        up = einsum32("nh,nkih->nki", xt, ex["up"][top_i])
        act = (jax.nn.silu(gate) * up).astype(xt.dtype)
        out = einsum32("nki,nkhi->nkh", act, ex["down"][top_i])
        return einsum32("nkh,nk->nh", out.astype(xt.dtype), top_w).astype(xt.dtype)
    gate = einsum32("nh,eih->nei", xt, ex["gate"])
    up = einsum32("nh,eih->nei", xt, ex["up"])
    act = (jax.nn.silu(gate) * up).astype(xt.dtype)
    out = einsum32("nei,ehi->neh", act, ex["down"])
    combine = jnp.zeros((n, e), xt.dtype).at[jnp.arange(n)[:, None], top_i].set(top_w)
    return einsum32("neh,ne->nh", out.astype(xt.dtype), combine).astype(xt.dtype)


def _by_expert(top_i: jax.Array, num_experts: int):
    """The N * k (token, expert) pairs sorted by expert: (order [N * k], the token of each
    sorted pair, rows per expert [E])."""
    k = top_i.shape[1]
    flat = top_i.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
    return order, (order // k).astype(jnp.int32), sizes


def _combine(out: jax.Array, order: jax.Array, top_w: jax.Array) -> jax.Array:
    """Each token's k expert outputs (rows of `out` [N * k, H] in sorted order) weighted and
    summed, in fp32: a gather of every token's rows and a reduction (no scatter: the sums'
    order is fixed, so results do not vary from run to run)."""
    n, k = top_w.shape
    where = jnp.argsort(order)  # the sorted row of each (token, choice) pair
    rows = out[where].reshape(n, k, out.shape[-1]).astype(jnp.float32)
    return jnp.einsum("nkh,nk->nh", rows, top_w.astype(jnp.float32)).astype(out.dtype)


# lhs [M, in] rows grouped by expert x rhs [E, out, in] -> [M, out]: each row meets its expert
_GROUPED = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((1,), (2,)), ((), ())), lhs_ragged_dimensions=(0,),
    rhs_group_dimensions=(0,))


def experts_grouped(ex: dict, xt: jax.Array, top_i: jax.Array, top_w: jax.Array) -> jax.Array:
    """The routed experts as XLA's grouped GEMMs: the N * k (token, expert) pairs sorted by
    expert, one `ragged_dot` per projection over the experts' row groups, then each pair's
    output weighted and added back to its token (TPU; XLA:GPU and XLA:CPU expand a
    `ragged_dot` over every expert)."""
    order, token, sizes = _by_expert(top_i, ex["gate"].shape[0])
    rows = xt[token]

    def grouped(lhs, rhs):
        return jax.lax.ragged_dot_general(lhs, rhs, sizes, _GROUPED,
                                          preferred_element_type=jnp.float32)

    gate, up, down = (materialize(ex[name], xt.dtype) for name in ("gate", "up", "down"))
    act = (jax.nn.silu(grouped(rows, gate)) * grouped(rows, up)).astype(xt.dtype)
    return _combine(grouped(act, down).astype(xt.dtype), order, top_w)


def experts_kernel(ex, xt: jax.Array, top_i: jax.Array, top_w: jax.Array,
                   sharding: str = "intermediate", interpret: bool = False) -> jax.Array:
    """The routed experts as the Pallas grouped matmul (`pallas_kernels.grouped_matmul`, GPUs):
    the (token, expert) pairs sorted by expert, the fused SwiGLU of gate and up over the
    tokens' rows gathered in the kernel, then down; only experts with rows are read, quantized
    experts dequantized tile by tile, a `LayerOf` indexed in place. On a tensor-parallel mesh
    it runs per device under `shard_map` over the experts' split (`sharding`: each device a
    slice of every expert's intermediate rows, or whole experts) and the partial outputs are
    summed; weights the kernel does not take (`grouped_matmul.supports`) or a split their
    values or scales do not divide evenly fall back to `experts_grouped`. `interpret`: the kernel in the Pallas interpreter (CPU tests)."""
    stack, layer = (ex.stack, ex.index.reshape(1)) if isinstance(ex, LayerOf) else (ex, None)
    lead = 0 if layer is None else 1
    num_experts = stack["gate"].shape[lead]
    if not all(grouped_supports(stack[name]) for name in ("gate", "down")):
        return experts_grouped(_sliced(ex), xt, top_i, top_w)
    order, token, sizes = _by_expert(top_i, num_experts)

    def run(stack, xt, token, sizes, offset):
        act = grouped_matmul(xt, stack["gate"], sizes, w_up=stack["up"], row_ids=token,
                             layer=layer, expert_offset=offset, interpret=interpret)
        return grouped_matmul(act, stack["down"], sizes, layer=layer, expert_offset=offset,
                              interpret=interpret)

    mesh = jax.sharding.get_abstract_mesh()
    tp = 1 if mesh.empty or TP_AXIS not in mesh.axis_names else mesh.shape[TP_AXIS]
    if tp == 1:
        return _combine(run(stack, xt, token, sizes, None), order, top_w)
    # the split axis of gate/up and of down, counted from the end of [(L,) E, out, in]
    axes = {"intermediate": (-2, -1), "expert": (-3, -3)}[sharding]
    specs = {name: _split_spec(stack[name], axis, tp)
             for name, axis in zip(("gate", "up", "down"), (axes[0], axes[0], axes[1]))}
    if any(spec is None for spec in specs.values()):
        return experts_grouped(_sliced(ex), xt, top_i, top_w)
    local = num_experts // tp

    def per_device(stack, xt, token, sizes):
        offset = None
        if sharding == "expert":
            offset = (jax.lax.axis_index(TP_AXIS) * local).astype(jnp.int32).reshape(1)
        return jax.lax.psum(run(stack, xt, token, sizes, offset), TP_AXIS)

    out = jax.shard_map(per_device, in_specs=(specs, P(), P(), P()), out_specs=P(),
                        check_vma=False)(stack, xt, token, sizes)
    return _combine(out, order, top_w)


def grouped_supports(w) -> bool:
    """Whether the grouped kernel takes expert weight `w` ([.., N, K], maybe quantized)."""
    *_, n, k = w.shape
    if not isinstance(w, QArray):
        return supports(n, k)
    if w.method == "fp8":
        return w.block == (FP8_BLOCK, FP8_BLOCK) and supports(n, k, "fp8")
    return supports(n, k, w.method, w.block[1])


def _split_spec(w, axis: int, parts: int):
    """The PartitionSpec (a QArray: one per field) splitting weight `w` along `axis` of its
    logical [..., out, in] shape into `parts`, or None when a stored field does not divide."""
    fields = (w.q, w.scale) if isinstance(w, QArray) else (w,)
    specs = []
    for f in fields:
        if f.shape[axis] % parts:
            return None
        spec = [None] * f.ndim
        spec[f.ndim + axis] = TP_AXIS
        specs.append(P(*spec))
    return dataclasses.replace(w, q=specs[0], scale=specs[1]) if isinstance(w, QArray) \
        else specs[0]


def mlp(p: dict, x: jax.Array, cfg: ModelConfig, moe_sharding: str = "intermediate"
        ) -> jax.Array:
    """The layer's feed-forward: SwiGLU for the dense variant, MoE for the MoE variant
    (`moe_sharding`: how a tensor-parallel mesh splits its experts)."""
    return moe(p, x, cfg, moe_sharding) if cfg.variant == "moe" else swiglu(p, x)
