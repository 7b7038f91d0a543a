"""The Qwen3.6 vision tower: patch embedding, ViT blocks with 2-D rotary, the patch merger.

Owns the vision encoder's static config and its forward pass (DESIGN §14). The input is a packed
sequence of patches of one or more images or videos (the processor's `pixel_values`, one row per
patch of C x temporal_patch x patch x patch values, in spatial-merge-block order) and their grids
(t, h, w) in patches. Everything that depends on the grids only (the learned position table's
bilinear resampling, the rotary coordinates, which patches attend to which) is computed on the
host by `vision_layout` as small arrays, so one compiled encoder serves every set of grids with
the same padded patch count; padding patches sit in a segment of their own and are dropped.

Maths, as transformers' `Qwen3_5VisionModel`: x = PatchEmbed(patches) + bilinear(pos_embed);
blocks of x += Attn(LN(x)) (full attention within each frame, rotary over (row, col) on the
whole head dim), x += MLP(LN(x)) (gelu tanh); merged = fc2(gelu(fc1(LN(x) viewed 4 patches a
row))). Every matmul accumulates in fp32.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ninfer_jax.models.qwen3_6.config import VisionConfig
from ninfer_jax.models.qwen3_6.layers import linear32


def vision_param_shapes(v: VisionConfig) -> dict:
    """The vision params' leaf shapes (tuples as leaves); blocks stacked on a leading axis."""
    h, i, n, m = v.hidden_size, v.intermediate_size, v.depth, v.hidden_size * v.merge_unit
    block = {"norm1_w": (h,), "norm1_b": (h,), "norm2_w": (h,), "norm2_b": (h,),
             "qkv_w": (3 * h, h), "qkv_b": (3 * h,), "proj_w": (h, h), "proj_b": (h,),
             "fc1_w": (i, h), "fc1_b": (i,), "fc2_w": (h, i), "fc2_b": (h,)}
    return {
        "patch_w": (h, v.patch_dim), "patch_b": (h,),
        "pos_embed": (v.num_position_embeddings, h),
        "blocks": {k: (n, *s) for k, s in block.items()},
        "merger": {"norm_w": (h,), "norm_b": (h,), "fc1_w": (m, m), "fc1_b": (m,),
                   "fc2_w": (v.out_hidden_size, m), "fc2_b": (v.out_hidden_size,)},
    }


# HF names (under model.visual.) of each leaf; {i} is the block index.
HF_NAMES = {
    "patch_b": "patch_embed.proj.bias", "pos_embed": "pos_embed.weight",
    "norm1_w": "blocks.{i}.norm1.weight", "norm1_b": "blocks.{i}.norm1.bias",
    "norm2_w": "blocks.{i}.norm2.weight", "norm2_b": "blocks.{i}.norm2.bias",
    "qkv_w": "blocks.{i}.attn.qkv.weight", "qkv_b": "blocks.{i}.attn.qkv.bias",
    "proj_w": "blocks.{i}.attn.proj.weight", "proj_b": "blocks.{i}.attn.proj.bias",
    "fc1_w": "blocks.{i}.mlp.linear_fc1.weight", "fc1_b": "blocks.{i}.mlp.linear_fc1.bias",
    "fc2_w": "blocks.{i}.mlp.linear_fc2.weight", "fc2_b": "blocks.{i}.mlp.linear_fc2.bias",
}
HF_MERGER = {"norm_w": "merger.norm.weight", "norm_b": "merger.norm.bias",
             "fc1_w": "merger.linear_fc1.weight", "fc1_b": "merger.linear_fc1.bias",
             "fc2_w": "merger.linear_fc2.weight", "fc2_b": "merger.linear_fc2.bias"}
HF_PATCH_W = "patch_embed.proj.weight"  # Conv3d [h, C, tp, p, p]


def vision_params_from_hf(get, v: VisionConfig) -> dict:
    """The vision params (numpy leaves) from `get(name, shape)` over model.visual.* names."""
    shapes = vision_param_shapes(v)
    h = v.hidden_size
    conv = get(HF_PATCH_W, (h, v.in_channels, v.temporal_patch_size, v.patch_size,
                            v.patch_size))
    blocks = {k: np.stack([get(HF_NAMES[k].format(i=i), s[1:]) for i in range(v.depth)])
              for k, s in shapes["blocks"].items()}
    return {
        "patch_w": np.ascontiguousarray(np.asarray(conv).reshape(h, v.patch_dim)),
        "patch_b": get(HF_NAMES["patch_b"], shapes["patch_b"]),
        "pos_embed": get(HF_NAMES["pos_embed"], shapes["pos_embed"]),
        "blocks": blocks,
        "merger": {k: get(HF_MERGER[k], s) for k, s in shapes["merger"].items()},
    }


def hf_vision_tensors(params: dict, v: VisionConfig) -> dict[str, np.ndarray]:
    """The inverse of `vision_params_from_hf`: HF names (without the model.visual. prefix)."""
    out = {HF_PATCH_W: np.asarray(params["patch_w"]).reshape(
        v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)}
    out[HF_NAMES["patch_b"]] = np.asarray(params["patch_b"])
    out[HF_NAMES["pos_embed"]] = np.asarray(params["pos_embed"])
    for k, stacked in params["blocks"].items():
        for i in range(v.depth):
            out[HF_NAMES[k].format(i=i)] = np.asarray(stacked[i])
    for k, name in HF_MERGER.items():
        out[name] = np.asarray(params["merger"][k])
    return out


# Host-side layout ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class VisionLayout:
    """What the encoder needs besides the patches, for a padded patch count N (N a multiple of
    the merge unit): interpolation taps `pos_index` [N, 4] int32 into the pos_embed table and
    their `pos_weight` [N, 4] fp32, rotary coordinates `rope_hw` [N, 2] int32 (row, col), and
    `segment` [N] int32: patches attend only within their segment (one per frame; padding has
    its own). `num_patches` real patches come first."""

    pos_index: np.ndarray
    pos_weight: np.ndarray
    rope_hw: np.ndarray
    segment: np.ndarray
    num_patches: int

    def arrays(self) -> tuple[np.ndarray, ...]:
        return self.pos_index, self.pos_weight, self.rope_hw, self.segment


def _axis_taps(index: np.ndarray, size: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Bilinear taps (floor, floor + 1), clamped to the table, and their weights, for target
    positions `index` on an axis of `size` cells resampled from `side` (align_corners=True),
    computed in fp32 as transformers does."""
    index = index.astype(np.float32)
    src = index * np.float32(side - 1) / np.maximum(size - 1, 1).astype(np.float32)
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    weights = np.clip(1 - np.abs(src[:, None] - floor[:, None] - offsets), 0, None)
    return taps, weights.astype(np.float32)


def grid_patches(grid: tuple[int, int, int]) -> int:
    t, h, w = grid
    return t * h * w


def vision_layout(grids: list[tuple[int, int, int]], v: VisionConfig,
                  padded: int | None = None) -> VisionLayout:
    """The host-side arrays for images/videos of `grids` (t, h, w) in patches, packed in order,
    padded to `padded` patches (default: no padding)."""
    m, side = v.spatial_merge_size, v.grid_side
    rows, cols, heights, widths, segments = [], [], [], [], []
    segment = 0
    for t, h, w in grids:
        if t <= 0 or h <= 0 or w <= 0 or h % m or w % m:
            raise ValueError(f"grid (t, h, w) = {(t, h, w)} must be positive with h and w "
                             f"multiples of spatial_merge_size {m}")
        within = np.arange(h * w)
        in_col, in_row = within % m, (within // m) % m
        block_col = (within // (m * m)) % (w // m)
        block_row = within // (m * m * (w // m))
        row, col = block_row * m + in_row, block_col * m + in_col
        for _ in range(t):
            rows.append(row)
            cols.append(col)
            heights.append(np.full(h * w, h))
            widths.append(np.full(h * w, w))
            segments.append(np.full(h * w, segment))
            segment += 1
    n = sum(grid_patches(g) for g in grids)
    padded = n if padded is None else padded
    if padded < n or padded % v.merge_unit:
        raise ValueError(f"padded patch count {padded} must be >= {n} and a multiple of "
                         f"{v.merge_unit}")
    row, col = np.concatenate(rows), np.concatenate(cols)
    h_taps, h_w = _axis_taps(row, np.concatenate(heights), side)
    w_taps, w_w = _axis_taps(col, np.concatenate(widths), side)
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(n, 4)
    weight = (h_w[:, :, None] * w_w[:, None, :]).reshape(n, 4)
    pad = padded - n

    def padded_to(a: np.ndarray, fill) -> np.ndarray:
        return np.concatenate([a, np.full((pad, *a.shape[1:]), fill, a.dtype)])

    return VisionLayout(
        pos_index=padded_to(index.astype(np.int32), 0),
        pos_weight=padded_to(weight, 0.0),
        rope_hw=padded_to(np.stack([row, col], -1).astype(np.int32), 0),
        segment=padded_to(np.concatenate(segments).astype(np.int32), segment),
        num_patches=n)


# The encoder -------------------------------------------------------------------------------

def _layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    mu = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mu), axis=-1, keepdims=True)
    y = (xf - mu) * jax.lax.rsqrt(var + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)
    return y.astype(x.dtype)


def _linear(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    return (linear32(x, w) + b.astype(jnp.float32)).astype(x.dtype)


def _gelu(x: jax.Array, act: str) -> jax.Array:
    xf = x.astype(jnp.float32)
    return jax.nn.gelu(xf, approximate=act == "gelu_pytorch_tanh").astype(x.dtype)


def _rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rope(hw: jax.Array, v: VisionConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin [N, head_dim] (fp32): the row's angles on the first quarter of each half, the
    column's on the second."""
    spatial = v.head_dim // 2
    inv_freq = 1.0 / (v.rope_theta ** (jnp.arange(0, spatial, 2, dtype=jnp.float32) / spatial))
    freqs = hw.astype(jnp.float32)[..., None] * inv_freq  # [N, 2, head_dim / 4]
    emb = jnp.concatenate([freqs[:, 0], freqs[:, 1]], axis=-1)
    emb = jnp.concatenate([emb, emb], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def _block(p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: jax.Array,
           v: VisionConfig) -> jax.Array:
    n, nh, hd = x.shape[0], v.num_heads, v.head_dim
    y = _layer_norm(x, p["norm1_w"], p["norm1_b"], v.layer_norm_eps)
    qkv = _linear(y, p["qkv_w"], p["qkv_b"]).reshape(n, 3, nh, hd)
    q, k, val = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    c, s = cos[:, None, :], sin[:, None, :]
    qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
    q = (qf * c + _rotate_half(qf) * s).astype(x.dtype)
    k = (kf * c + _rotate_half(kf) * s).astype(x.dtype)
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(mask[None], scores * (hd ** -0.5), -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("hqk,khd->qhd", probs, val.astype(jnp.float32)).astype(x.dtype)
    x = x + _linear(out.reshape(n, nh * hd), p["proj_w"], p["proj_b"])
    y = _layer_norm(x, p["norm2_w"], p["norm2_b"], v.layer_norm_eps)
    y = _linear(_gelu(_linear(y, p["fc1_w"], p["fc1_b"]), v.hidden_act), p["fc2_w"], p["fc2_b"])
    return x + y


def encode(params: dict, v: VisionConfig, patches: jax.Array, pos_index: jax.Array,
           pos_weight: jax.Array, rope_hw: jax.Array, segment: jax.Array) -> jax.Array:
    """Merged vision embeddings [N / merge_unit, out_hidden] for patches [N, patch_dim] and
    their `vision_layout` arrays. Rows that come from padding patches are garbage-free but
    meaningless; the caller keeps the first num_patches / merge_unit."""
    dtype = params["patch_w"].dtype
    x = _linear(patches.astype(dtype), params["patch_w"], params["patch_b"])
    table = params["pos_embed"]
    pos = jnp.sum(table[pos_index].astype(jnp.float32) * pos_weight[..., None], axis=1)
    x = x + pos.astype(dtype)
    cos, sin = _rope(rope_hw, v)
    mask = segment[:, None] == segment[None, :]

    def body(x, p):
        return _block(p, x, cos, sin, mask, v), None

    x, _ = jax.lax.scan(body, x, params["blocks"])
    m = params["merger"]
    y = _layer_norm(x, m["norm_w"], m["norm_b"], v.layer_norm_eps)
    y = y.reshape(x.shape[0] // v.merge_unit, v.merge_unit * v.hidden_size)
    y = _linear(_gelu(_linear(y, m["fc1_w"], m["fc1_b"]), "gelu"), m["fc2_w"], m["fc2_b"])
    return y
