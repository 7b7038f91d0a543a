"""Quantized weights: a linear weight held as low-bit values plus scales, dequantized on the fly.

Owns the three weight formats and their arithmetic; the layers call `dequantize` through
`layers.linear32` / `layers.einsum32`, so every matmul accepts a `QArray` where it takes a
weight array, and the model code does not change.

- "int8" / "int4": weight-only, symmetric, group-wise along the input dim (AWQ/GPTQ-style, no
  zero point): each run of `group` input channels of one output row shares an fp32 scale
  (amax / 127 or amax / 7), values rounded to nearest. int4 packs two values a byte along the
  input dim: byte j of a row holds channel 2j in its low nibble and 2j + 1 in its high one, each
  as value + 8 (1..15): the layout XLA:CPU unpacks fastest of those tried (nibble pairs
  unpack with one shift and mask each, no concatenation); the Pallas kernel permutes the
  activations to meet it, see `pallas_kernels.quant_matmul`.
  `group` is 128, or (an input dim not divisible by 128) its largest divisor up to 128 that is
  even, recorded per weight.
- "fp8": the official fine-grained FP8 checkpoints (`float8_e4m3fn` values, one fp32 scale —
  HF's `weight_scale_inv`, a multiplier despite the name — per 128x128 block of [out, in],
  partial blocks at the edges).

Which weights are quantized: the projections of the decoder and MTP layers (attention q/k/v/o,
GDN in_qkv/in_z/out, the MLP's or experts' and shared expert's gate/up/down) — the set the
official Qwen FP8 checkpoints quantize. Embeddings, lm_head, norms, the router, the shared-expert
gate, GDN's small in_a/in_b, conv and the vision tower stay in the model dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ninfer_jax.errors import ConfigError

METHODS = ("int8", "int4", "fp8")
CONVERT_METHODS = ("int8", "int4")  # what `ninfer convert --quantize` / `quantize=` produce
GROUP = 128
FP8_BLOCK = (128, 128)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
# The leaves (last key) quantized, anywhere under the decoder or MTP layers.
QUANTIZED_LEAVES = frozenset({"q", "k", "v", "o", "in_qkv", "in_z", "out", "gate", "up", "down"})
_STORED = {"int8": np.dtype(np.int8), "int4": np.dtype(np.uint8),
           "fp8": np.dtype(ml_dtypes.float8_e4m3fn)}


@functools.partial(jax.tree_util.register_dataclass, data_fields=["q", "scale"],
                   meta_fields=["method", "block"])
@dataclasses.dataclass(frozen=True)
class QArray:
    """A quantized weight [..., out, in] (nn.Linear's layout; leading dims: layers, experts).

    q: int8 [..., out, in] | uint8 [..., out, in / 2] (int4, packed) | float8_e4m3fn
    [..., out, in]; scale: float32 [..., ceil(out / block[0]), ceil(in / block[1])] (int: block
    (1, group)). Leading dims index like an array's (`a[i]`, `a[ids]`), so stacked layers and
    gathered experts work unchanged.
    """

    q: jax.Array
    scale: jax.Array
    method: str
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, out, cols = self.q.shape
        return (*lead, out, cols * 2 if self.method == "int4" else cols)

    @property
    def ndim(self) -> int:
        return self.q.ndim

    @property
    def nbytes(self) -> int:
        return _nbytes(self.q) + _nbytes(self.scale)

    def __getitem__(self, index) -> QArray:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) > self.q.ndim - 2 or any(i is Ellipsis for i in index):
            raise IndexError("a QArray indexes its leading (layer, expert) dims only")
        return dataclasses.replace(self, q=self.q[index], scale=self.scale[index])

    def dequantize(self, dtype=jnp.float32) -> jax.Array:
        """The weight [..., out, in] in `dtype` (the products in fp32)."""
        *lead, out, cols = self.shape
        scale = self.scale.astype(jnp.float32)
        if self.method == "fp8":
            rows, width = self.block
            s = jnp.repeat(jnp.repeat(scale, rows, axis=-2)[..., :out, :], width, axis=-1)
            return (self.q.astype(jnp.float32) * s[..., :cols]).astype(dtype)
        group = self.block[1]
        if self.method == "int8":
            w = self.q.astype(jnp.float32).reshape(*lead, out, cols // group, group)
        else:
            w = jnp.stack([self.q & 15, self.q >> 4], axis=-1).astype(jnp.float32) - 8.0
            w = w.reshape(*lead, out, cols // group, group)
        return (w * scale[..., None]).reshape(*lead, out, cols).astype(dtype)


def _nbytes(a) -> int:
    return math.prod(a.shape) * np.dtype(a.dtype).itemsize


def is_quantized(x) -> bool:
    return isinstance(x, QArray)


def materialize(w, dtype=None):
    """`w` as an array: a QArray dequantized (in `dtype`, default fp32), an array as it is."""
    if isinstance(w, QArray):
        return w.dequantize(jnp.float32 if dtype is None else dtype)
    return w


def check_method(method: str | None, allowed=METHODS, field: str = "quantize") -> str | None:
    if method is not None and method not in allowed:
        raise ConfigError(f"{field} must be one of {list(allowed)} or None, got {method!r}")
    return method


def group_size(cols: int, group: int = GROUP) -> int:
    """The input-channel group of a weight with `cols` inputs: `group` when it divides cols,
    else the largest even divisor of cols up to `group`."""
    if cols % group == 0:
        return group
    for g in range(min(group, cols), 1, -1):
        if cols % g == 0 and g % 2 == 0:
            return g
    raise ConfigError(f"a weight with {cols} input channels has no even group size <= {group}")


def quantize_int(w: np.ndarray, method: str, group: int = GROUP) -> QArray:
    """Symmetric group-wise quantization of w [..., out, in] (numpy, any float dtype)."""
    *lead, out, cols = w.shape
    g = group_size(cols, group)
    wf = np.asarray(w, np.float32).reshape(*lead, out, cols // g, g)
    top = 127 if method == "int8" else 7
    amax = np.abs(wf).max(axis=-1)
    scale = (amax / top).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0)[..., None]
    v = np.clip(np.rint(wf / safe), -top, top).astype(np.int32)
    if method == "int8":
        q = v.astype(np.int8).reshape(*lead, out, cols)
    else:
        u = (v + 8).astype(np.uint8).reshape(*lead, out, cols)
        q = u[..., 0::2] | (u[..., 1::2] << 4)
    return QArray(q=q, scale=scale, method=method, block=(1, g))


def fp8_blocks(w: np.ndarray, block: tuple[int, int] = FP8_BLOCK) -> QArray:
    """w [..., out, in] quantized to FP8 the way the official checkpoints are: per block,
    scale = amax / 448, values w / scale rounded to float8_e4m3fn (test fixtures, benches)."""
    *lead, out, cols = w.shape
    br, bc = block
    nr, nc = -(-out // br), -(-cols // bc)
    wf = np.zeros((*lead, nr * br, nc * bc), np.float32)
    wf[..., :out, :cols] = w
    tiles = wf.reshape(*lead, nr, br, nc, bc)
    amax = np.abs(tiles).max(axis=(-3, -1))
    scale = (amax / FP8_MAX).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0)
    q = (tiles / safe[..., :, None, :, None]).reshape(*lead, nr * br, nc * bc)
    return QArray(q=q[..., :out, :cols].astype(ml_dtypes.float8_e4m3fn), scale=scale,
                  method="fp8", block=block)


def quantizes(path: tuple[str, ...]) -> bool:
    """Whether the params leaf at key path `path` is one `quantize_params` quantizes."""
    return path[0] in ("linear", "attention", "layers", "mtp") and path[-1] in QUANTIZED_LEAVES


def _key(k) -> str:
    return getattr(k, "key", getattr(k, "name", k))


def quantize_params(params: dict, method: str, group: int = GROUP) -> dict:
    """Params with the weights `quantizes` names replaced by QArrays of `method` (int8|int4),
    as numpy (place them with `jax.device_put`)."""
    check_method(method, CONVERT_METHODS)

    def one(path, leaf):
        if isinstance(leaf, QArray):
            raise ConfigError(f"params are quantized already ({leaf.method}); quantize the "
                              "float checkpoint")
        key = tuple(_key(k) for k in path)
        return quantize_int(np.asarray(leaf), method, group) if quantizes(key) else leaf

    return jax.tree_util.tree_map_with_path(one, params, is_leaf=is_quantized)


def dequantize_params(params: dict, dtype=np.float32) -> dict:
    """Params with every QArray dequantized (numpy, `dtype`): the float model the quantized
    one computes."""
    def one(leaf):
        if isinstance(leaf, QArray):
            return np.asarray(leaf.dequantize(jnp.float32)).astype(dtype)
        return leaf

    return jax.tree.map(one, params, is_leaf=is_quantized)


def cast_params(params: dict, dtype) -> dict:
    """Params as device arrays in `dtype`; a QArray keeps its stored values and fp32 scales."""
    def one(leaf):
        if isinstance(leaf, QArray):
            return QArray(jnp.asarray(leaf.q), jnp.asarray(leaf.scale, jnp.float32),
                          leaf.method, leaf.block)
        return jnp.asarray(leaf, dtype)

    return jax.tree.map(one, params, is_leaf=is_quantized)


def method_of(params: dict) -> str | None:
    """The quantization of `params` (None: none)."""
    methods = {leaf.method for leaf in jax.tree.leaves(params, is_leaf=is_quantized)
               if isinstance(leaf, QArray)}
    if len(methods) > 1:
        raise ConfigError(f"params mix quantizations {sorted(methods)}")
    return methods.pop() if methods else None


def stored_dtype(method: str) -> np.dtype:
    return _STORED[method]


def weight_bytes(params: dict) -> int:
    """The bytes the params occupy (a QArray: its values and scales)."""
    return sum(leaf.nbytes if isinstance(leaf, QArray) else _nbytes(leaf)
               for leaf in jax.tree.leaves(params, is_leaf=is_quantized))


def hf_fp8_block(config: dict) -> tuple[int, int]:
    """The FP8 scale block of an HF config.json (its `quantization_config`, or the text
    config's); FP8_BLOCK without one. Any other quantization is a CheckpointError: loading it
    as float weights would be wrong."""
    from ninfer_jax.errors import CheckpointError

    qc = config.get("quantization_config") or (config.get("text_config") or {}).get(
        "quantization_config")
    if qc is None:
        return FP8_BLOCK
    method = qc.get("quant_method")
    if method != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(
            f"config.json quantization_config is {method!r} (fmt {qc.get('fmt')!r}); this "
            "engine loads fine-grained FP8 checkpoints (quant_method 'fp8', fmt 'e4m3') and "
            "float ones; for int8/int4 convert a float checkpoint with `ninfer convert "
            "--quantize`")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(n, int) and n > 0 for n in block)):
        raise CheckpointError("config.json quantization_config.weight_block_size must be "
                              f"[rows, cols] (positive ints), got {block!r}; per-tensor FP8 "
                              "scales are not supported")
    return tuple(block)


def key_path(path) -> tuple[str, ...]:
    """A pytree key path (dict keys, a QArray's fields) as a tuple of names."""
    return tuple(str(_key(k)) for k in path)


def record(params: dict) -> dict | None:
    """What an artifact's manifest records of `params`' quantization (None: none): the method
    and, per quantized leaf (dotted name), its scale block."""
    method = method_of(params)
    if method is None:
        return None
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_quantized)[0]
    return {"method": method,
            "blocks": {".".join(key_path(p)): list(leaf.block) for p, leaf in flat
                       if isinstance(leaf, QArray)}}


def check_record(quantization) -> dict | None:
    """A manifest's `quantization` entry, checked (ValueError saying what is wrong)."""
    if quantization is None:
        return None
    if not isinstance(quantization, dict) or quantization.get("method") not in METHODS:
        raise ValueError(f"'quantization' must be an object whose method is one of {METHODS}")
    blocks = quantization.get("blocks")
    if not isinstance(blocks, dict) or not all(
            isinstance(b, list) and len(b) == 2 and all(isinstance(n, int) and n > 0 for n in b)
            for b in blocks.values()):
        raise ValueError("'quantization.blocks' must map tensor names to [rows, cols] blocks")
    return quantization


def spec_tree(shapes: dict, quantization: dict | None) -> dict:
    """The schema's shape tree (tuples as leaves) with each leaf `quantization` names replaced
    by a QArray of (values shape, scale shape) tuples."""
    if quantization is None:
        return shapes
    method, blocks = quantization["method"], quantization["blocks"]

    def one(path, shape):
        block = blocks.get(".".join(key_path(path)))
        if block is None:
            return shape
        *lead, out, cols = shape
        rows, width = block
        values = (*lead, out, cols // 2 if method == "int4" else cols)
        scale = (*lead, -(-out // rows), -(-cols // width))
        return QArray(q=values, scale=scale, method=method, block=tuple(block))

    return jax.tree_util.tree_map_with_path(one, shapes, is_leaf=lambda x: isinstance(x, tuple))


def leaf_dtypes(shapes: dict, quantization: dict | None, dtype: str) -> dict[str, np.dtype]:
    """{dotted name: stored dtype} of every stored tensor of `spec_tree(shapes, quantization)`."""
    tree = spec_tree(shapes, quantization)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, tuple))[0]
    out = {}
    for path, _ in flat:
        names = key_path(path)
        if quantization is not None and names[-1] in ("q", "scale") and \
                ".".join(names[:-1]) in quantization["blocks"]:
            out[".".join(names)] = (stored_dtype(quantization["method"]) if names[-1] == "q"
                                    else np.dtype(np.float32))
        else:
            out[".".join(names)] = np.dtype(dtype)
    return out


def decode_weight_bytes(params: dict, cfg) -> int:
    """The weight bytes one decode step reads: every weight (values and scales) but the MTP
    head's, the vision tower's and an untied embedding table's (one row of it is read)."""
    skip = {"mtp", "vision", "dflash"} | (set() if cfg.tie_word_embeddings else {"embed"})
    return sum(weight_bytes(v) if isinstance(v, dict) else weight_bytes({"": v})
               for k, v in params.items() if k not in skip)


def planned_record(shapes: dict, method: str) -> dict:
    """The `record` that quantizing params of `shapes` (the schema's shape tree) with `method`
    gives: int8/int4 group-wise, fp8 in FP8_BLOCK blocks (`ninfer plan`)."""
    flat = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))[0]
    return blocks_record(((key_path(p), s) for p, s in flat), method)


def blocks_record(leaves, method: str) -> dict:
    """The `record` of quantizing, with `method`, the leaves `quantizes` names among `leaves`
    ((key path, shape) pairs)."""
    check_method(method)
    return {"method": method, "blocks": {
        ".".join(path): list(FP8_BLOCK if method == "fp8" else (1, group_size(shape[-1])))
        for path, shape in leaves if quantizes(path)}}


def planned_structs(shapes: dict, method: str | None, dtype: str) -> dict:
    """Params of `shapes` (the schema's shape tree) as `jax.ShapeDtypeStruct`s: in `dtype`, and
    with `method` (None: none) quantized as `quantize_params` / the FP8 loader hold them (QArrays
    of values and fp32 scales). What a Program holds, without a byte of it."""
    record_ = None if method is None else planned_record(shapes, method)
    dtypes = leaf_dtypes(shapes, record_, dtype)
    return jax.tree_util.tree_map_with_path(
        lambda p, s: jax.ShapeDtypeStruct(s, dtypes[".".join(key_path(p))]),
        spec_tree(shapes, record_), is_leaf=lambda x: isinstance(x, tuple))


def planned_bytes(shapes: dict, method: str | None, dtype: str) -> int:
    """The bytes of params of `shapes` in `dtype`, quantized with `method` (None: not)."""
    return sum(_nbytes(a) for a in jax.tree.leaves(planned_structs(shapes, method, dtype)))
