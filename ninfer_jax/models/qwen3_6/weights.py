"""The weight schema: Hugging Face tensor names and shapes <-> this project's params pytree.

Owns the mapping of DESIGN §14's checkpoints (`model.*` or `model.language_model.*`, `lm_head.*`,
`mtp.*`; experts split per expert or fused) onto the stacked params layout. Every linear weight
keeps nn.Linear's [out, in] layout (experts [E, out, in]), the layout XLA:CPU's few-row matmuls
read fastest (`layers.dense`); artifacts of format 2 and older stored [in, out] and are turned
by `from_legacy_layout` at load. Every tensor is checked against the shape the config implies and must be
floating point (every weight of the family is); a missing tensor, a shape mismatch or an
int/bool/unsigned tensor raises a `CheckpointError` naming it: nothing else is ever cast. It
reads tensors through a `TensorSource` and knows nothing about files.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Protocol

import jax
import ml_dtypes
import numpy as np

from ninfer_jax import quant
from ninfer_jax.errors import CheckpointError
from ninfer_jax.models.qwen3_6.config import FULL, LINEAR, ModelConfig
from ninfer_jax.models.qwen3_6.vision import vision_param_shapes, vision_params_from_hf

TEXT_PREFIXES = ("model.language_model.", "model.")
VISION_PREFIX = "model.visual."
MTP_PREFIX = "mtp."
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


class TensorSource(Protocol):
    def keys(self) -> Iterable[str]: ...

    def get(self, name: str) -> np.ndarray: ...


def text_prefix(keys: Iterable[str]) -> str:
    """The prefix of the text decoder's tensors in this checkpoint."""
    keys = set(keys)
    for prefix in TEXT_PREFIXES:
        if f"{prefix}embed_tokens.weight" in keys:
            return prefix
    raise CheckpointError(
        "missing tensor 'model.embed_tokens.weight' (or 'model.language_model.embed_tokens.weight')"
    )


class _Reader:
    """Fetches tensors by name with shape checks, remembering which names were consumed."""

    def __init__(self, source: TensorSource, fp8_block: tuple[int, int] = quant.FP8_BLOCK):
        self.source, self.fp8_block = source, tuple(fp8_block)
        self.keys = set(source.keys())
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self.keys

    def get(self, name: str, shape: tuple[int, ...]) -> _Tensor:
        """The tensor `name` of `shape`, to be read when its leaf is (see `_Tensor`)."""
        if name not in self.keys:
            raise CheckpointError(f"missing tensor {name!r}")
        self.used.add(name)
        return _Tensor(self, name, tuple(shape))

    def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        arr = self.source.get(name)
        if arr.dtype.name not in FLOAT_DTYPES:
            raise CheckpointError(
                f"tensor {name!r} has dtype {arr.dtype.name}, expected a floating-point weight "
                f"({', '.join(FLOAT_DTYPES)}); it is not cast"
            )
        if tuple(arr.shape) != tuple(shape):
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}"
            )
        return arr

    def linear(self, name: str, out_dim: int, in_dim: int):
        """An nn.Linear weight [out, in], as it is stored; an FP8 one (a `<name>_scale_inv`
        beside it: the official fine-grained layout) as a QArray of its values and scales."""
        scale = f"{name}_scale_inv"
        if scale not in self.keys:
            return self.get(name, (out_dim, in_dim))
        br, bc = self.fp8_block
        for n in (name, scale):
            if n not in self.keys:
                raise CheckpointError(f"missing tensor {n!r}")
            self.used.add(n)
        return quant.QArray(
            q=_Raw(self, name, (out_dim, in_dim), (quant.stored_dtype("fp8"),)),
            scale=_Raw(self, scale, (-(-out_dim // br), -(-in_dim // bc)), _SCALE_DTYPES),
            method="fp8", block=(br, bc))

    def read_raw(self, name: str, shape: tuple[int, ...], dtypes) -> np.ndarray:
        """A quantized weight's values or scales, which keep their dtype (scales: fp32)."""
        arr = self.source.get(name)
        if arr.dtype not in dtypes:
            raise CheckpointError(f"tensor {name!r} has dtype {arr.dtype.name}, expected "
                                  f"{' or '.join(d.name for d in dtypes)}")
        if tuple(arr.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(arr.shape)}, expected "
                                  f"{tuple(shape)} (an FP8 weight's scales are one per "
                                  f"{self.fp8_block} block)")
        return arr.astype(np.float32) if dtypes is _SCALE_DTYPES else arr


_SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))


# Lazy leaves: what a params leaf is made of, read only when the leaf is. Each node knows its
# shape; `pieces(cast)` yields C-contiguous arrays whose bytes, in order, are the leaf's, so a
# stacked [L, ...] leaf is produced one layer at a time.
class _Tensor:
    """One HF tensor as stored."""

    def __init__(self, reader: _Reader, name: str, shape: tuple[int, ...]):
        self.reader, self.name, self.shape = reader, name, shape

    def pieces(self, cast):
        yield np.ascontiguousarray(cast(self.reader.read(self.name, self.shape)))


class _Raw:
    """A quantized weight's values or scales as stored: never cast."""

    def __init__(self, reader: _Reader, name: str, shape: tuple[int, ...], dtypes):
        self.reader, self.name, self.shape, self.dtypes = reader, name, shape, dtypes

    def pieces(self, cast):
        yield np.ascontiguousarray(self.reader.read_raw(self.name, self.shape, self.dtypes))


class _Map:
    """`fn` (a rearrangement: transpose, slice) of one node's array; `shape` is the result's."""

    def __init__(self, node, fn: Callable[[np.ndarray], np.ndarray], shape: tuple[int, ...]):
        self.node, self.fn, self.shape = node, fn, shape

    def pieces(self, cast):
        yield np.ascontiguousarray(self.fn(_materialize(self.node, cast)))


class _Stack:
    """Nodes of one shape stacked on a new leading axis."""

    def __init__(self, nodes):
        self.nodes, self.shape = tuple(nodes), (len(nodes), *nodes[0].shape)

    def pieces(self, cast):
        for node in self.nodes:
            yield from node.pieces(cast)


class _Part:
    """A leaf of a subtree built whole by another module's reader (the vision tower's
    `vision_params_from_hf`): the subtree is read when its first leaf is, and each leaf is
    dropped from it once handed out."""

    def __init__(self, whole: dict, path: tuple, shape: tuple[int, ...]):
        self.whole, self.path, self.shape = whole, path, shape

    def pieces(self, cast):
        if "tree" not in self.whole:
            self.whole["tree"] = dict(jax.tree_util.tree_flatten_with_path(self.whole["build"]())[0])
        yield np.ascontiguousarray(cast(self.whole["tree"].pop(self.path)))


_NODES = (_Tensor, _Raw, _Map, _Stack, _Part)


def _materialize(node, cast) -> np.ndarray:
    """The node's whole array: its pieces written one by one into one new array."""
    pieces = node.pieces(cast)
    first = next(pieces)
    if first.shape == node.shape:  # a single piece is the whole
        return first
    out = np.empty(node.shape, first.dtype)
    flat, at = out.reshape(-1), first.size
    flat[:at] = first.reshape(-1)
    del first
    for piece in pieces:
        flat[at:at + piece.size] = piece.reshape(-1)
        at += piece.size
    return out


def _mlp(r: _Reader, pre: str, cfg: ModelConfig) -> dict:
    h = cfg.hidden_size
    if cfg.variant == "dense":
        i = cfg.intermediate_size
        return {
            "gate": r.linear(f"{pre}mlp.gate_proj.weight", i, h),
            "up": r.linear(f"{pre}mlp.up_proj.weight", i, h),
            "down": r.linear(f"{pre}mlp.down_proj.weight", h, i),
        }
    e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    fused = f"{pre}mlp.experts.gate_up_proj"
    if r.has(fused):
        if r.has(f"{fused}_scale_inv"):
            raise CheckpointError(f"{fused!r} is FP8 with fused experts; FP8 checkpoints load "
                                  "with per-expert tensors (mlp.experts.<j>.gate_proj.weight)")
        gate_up = r.get(fused, (e, 2 * i, h))  # read once for each half
        experts = {
            "gate": _Map(gate_up, lambda a: a[:, :i], (e, i, h)),
            "up": _Map(gate_up, lambda a: a[:, i:], (e, i, h)),
            "down": r.get(f"{pre}mlp.experts.down_proj", (e, h, i)),
        }
    else:
        per = [
            (r.linear(f"{pre}mlp.experts.{j}.gate_proj.weight", i, h),
             r.linear(f"{pre}mlp.experts.{j}.up_proj.weight", i, h),
             r.linear(f"{pre}mlp.experts.{j}.down_proj.weight", h, i))
            for j in range(e)
        ]
        experts = {k: jax.tree.map(lambda *a: _Stack(a), *[p[n] for p in per])
                   for n, k in enumerate(("gate", "up", "down"))}
    return {
        "router": r.linear(f"{pre}mlp.gate.weight", e, h),
        "experts": experts,
        "shared": {
            "gate": r.linear(f"{pre}mlp.shared_expert.gate_proj.weight", s, h),
            "up": r.linear(f"{pre}mlp.shared_expert.up_proj.weight", s, h),
            "down": r.linear(f"{pre}mlp.shared_expert.down_proj.weight", h, s),
        },
        "shared_gate": r.linear(f"{pre}mlp.shared_expert_gate.weight", 1, h),
    }


def _attention_layer(r: _Reader, pre: str, cfg: ModelConfig) -> dict:
    h, d, hq, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_q_heads, cfg.num_kv_heads
    a = f"{pre}self_attn."
    return {
        "input_norm": r.get(f"{pre}input_layernorm.weight", (h,)),
        "post_norm": r.get(f"{pre}post_attention_layernorm.weight", (h,)),
        "mixer": {
            "q": r.linear(f"{a}q_proj.weight", hq * d * 2, h),
            "k": r.linear(f"{a}k_proj.weight", hkv * d, h),
            "v": r.linear(f"{a}v_proj.weight", hkv * d, h),
            "o": r.linear(f"{a}o_proj.weight", h, hq * d),
            "q_norm": r.get(f"{a}q_norm.weight", (d,)),
            "k_norm": r.get(f"{a}k_norm.weight", (d,)),
        },
        "mlp": _mlp(r, pre, cfg),
    }


def _linear_layer(r: _Reader, pre: str, cfg: ModelConfig) -> dict:
    h, hv, dv, k = cfg.hidden_size, cfg.linear_num_v_heads, cfg.linear_v_dim, cfg.conv_kernel
    a = f"{pre}linear_attn."
    conv = r.get(f"{a}conv1d.weight", (cfg.conv_dim, 1, k))
    return {
        "input_norm": r.get(f"{pre}input_layernorm.weight", (h,)),
        "post_norm": r.get(f"{pre}post_attention_layernorm.weight", (h,)),
        "mixer": {
            "in_qkv": r.linear(f"{a}in_proj_qkv.weight", cfg.conv_dim, h),
            "in_z": r.linear(f"{a}in_proj_z.weight", hv * dv, h),
            "in_b": r.linear(f"{a}in_proj_b.weight", hv, h),
            "in_a": r.linear(f"{a}in_proj_a.weight", hv, h),
            "conv": _Map(conv, lambda c: c[:, 0, :].T, (k, cfg.conv_dim)),
            "dt_bias": r.get(f"{a}dt_bias", (hv,)),
            "A_log": r.get(f"{a}A_log", (hv,)),
            "norm": r.get(f"{a}norm.weight", (dv,)),
            "out": r.linear(f"{a}out_proj.weight", h, hv * dv),
        },
        "mlp": _mlp(r, pre, cfg),
    }


def _stack(layers: list[dict]) -> dict:
    """Stacks per-layer dicts on a new leading axis; no layers of a kind gives {}."""
    return jax.tree.map(lambda *a: _Stack(a), *layers) if layers else {}


def _mtp(r: _Reader, cfg: ModelConfig) -> dict | None:
    layer_ids = sorted({int(m.group(1)) for k in r.keys
                        if (m := re.match(r"mtp\.layers\.(\d+)\.", k))})
    if not layer_ids:
        return None
    h = cfg.hidden_size
    return {
        "fc": r.linear("mtp.fc.weight", h, 2 * h),
        "embed_norm": r.get("mtp.pre_fc_norm_embedding.weight", (h,)),
        "hidden_norm": r.get("mtp.pre_fc_norm_hidden.weight", (h,)),
        "final_norm": r.get("mtp.norm.weight", (h,)),
        "layers": _stack([_attention_layer(r, f"mtp.layers.{j}.", cfg) for j in layer_ids]),
    }


class HFPlan:
    """What every params leaf is made of in one HF checkpoint, checked before any tensor data is
    read: every name the schema needs is present, none is unknown, every leaf has the schema's
    shape. Data is read leaf by leaf (`read`, `pieces`), so a caller that keeps one leaf at a
    time holds at most that leaf and one source tensor; tensor shapes and dtypes are checked as
    each is read. `notes` say what was skipped (e.g. the vision tower)."""

    def __init__(self, tree: dict, notes: list[str]):
        self.tree, self.notes = tree, notes  # tree: the params pytree with lazy nodes as leaves
        flat, self.treedef = jax.tree_util.tree_flatten_with_path(
            tree, is_leaf=lambda x: isinstance(x, _NODES))
        self._leaves = {quant.key_path(path): node for path, node in flat}

    def paths(self) -> list[tuple[str, ...]]:
        """Every leaf's key path in the params pytree, e.g. ("attention", "mixer", "q"), in
        pytree order."""
        return list(self._leaves)

    def shape(self, path: tuple[str, ...]) -> tuple[int, ...]:
        return self._leaves[path].shape

    def pieces(self, path: tuple[str, ...], cast=lambda a: a):
        """The leaf as C-contiguous arrays (`cast` applied to each source tensor) whose bytes in
        order are the leaf's: one per layer (per expert) for a stacked leaf."""
        return self._leaves[path].pieces(cast)

    def read(self, path: tuple[str, ...], cast=lambda a: a) -> np.ndarray:
        """The whole leaf as one new array."""
        return _materialize(self._leaves[path], cast)

    def num_mtp_layers(self) -> int:
        return self.shape(("mtp", "layers", "input_norm"))[0] if "mtp" in self.tree else 0


def _vision_names(v) -> list[str]:
    from ninfer_jax.models.qwen3_6.vision import HF_MERGER, HF_NAMES, HF_PATCH_W

    blocks = [HF_NAMES[k].format(i=i) for k in vision_param_shapes(v)["blocks"]
              for i in range(v.depth)]
    return [HF_PATCH_W, HF_NAMES["patch_b"], HF_NAMES["pos_embed"], *blocks, *HF_MERGER.values()]


def hf_plan(cfg: ModelConfig, source: TensorSource,
            fp8_block: tuple[int, int] = quant.FP8_BLOCK) -> HFPlan:
    """The HFPlan of `source` for `cfg`; tensors of the text model that the schema does not know
    raise, so a checkpoint is never half-read. FP8 weights (fine-grained, `fp8_block` scales:
    `quant.hf_fp8_block` of the config) become QArray leaves of their values and scales."""
    r = _Reader(source, fp8_block)
    pre = text_prefix(r.keys)
    h, v = cfg.hidden_size, cfg.vocab_size
    linear, attention = [], []
    for i, kind in enumerate(cfg.layer_types):
        layer_pre = f"{pre}layers.{i}."
        if kind == FULL:
            attention.append(_attention_layer(r, layer_pre, cfg))
        elif kind == LINEAR:
            linear.append(_linear_layer(r, layer_pre, cfg))
    params = {
        "embed": r.get(f"{pre}embed_tokens.weight", (v, h)),
        "final_norm": r.get(f"{pre}norm.weight", (h,)),
        "linear": _stack(linear),
        "attention": _stack(attention),
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = r.linear("lm_head.weight", v, h)
    elif r.has("lm_head.weight"):
        r.used.add("lm_head.weight")  # a tied copy saved by some exporters
    mtp = _mtp(r, cfg)
    if mtp is not None:
        params["mtp"] = mtp
    notes = []
    visual = sorted(k for k in r.keys if k.startswith(VISION_PREFIX))
    if cfg.vision is not None:
        for name in _vision_names(cfg.vision):
            r.get(VISION_PREFIX + name, ())  # present and consumed; read with the tower below
        whole = {"build": lambda: vision_params_from_hf(
            lambda name, shape: r.read(VISION_PREFIX + name, shape), cfg.vision)}
        flat = jax.tree_util.tree_flatten_with_path(
            vision_param_shapes(cfg.vision), is_leaf=lambda x: isinstance(x, tuple))[0]
        params["vision"] = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(vision_param_shapes(cfg.vision),
                                         is_leaf=lambda x: isinstance(x, tuple)),
            [_Part(whole, path, tuple(shape)) for path, shape in flat])
        visual = []  # every one is consumed now; an unknown one is reported below
    elif visual:
        notes.append(f"skipped the vision tower ({len(visual)} tensors under {VISION_PREFIX!r}"
                     f"; config.json has no vision_config)")
    unknown = sorted(r.keys - r.used - set(visual))
    if unknown:
        raise CheckpointError(
            f"{len(unknown)} tensors are not part of the {cfg.variant} Qwen3.6 schema for this "
            f"config, e.g. {unknown[:3]}"
        )
    check_param_shapes(cfg, jax.tree.map(lambda n: np.broadcast_to(np.float32(0), n.shape),
                                         params, is_leaf=lambda x: isinstance(x, _NODES)))
    return HFPlan(params, notes)


def params_from_hf(cfg: ModelConfig, source: TensorSource,
                   cast: Callable[[np.ndarray], np.ndarray] = lambda a: a,
                   fp8_block: tuple[int, int] = quant.FP8_BLOCK) -> tuple[dict, list[str]]:
    """Reads the params pytree (numpy leaves) from HF-named tensors, whole (`hf_plan` reads
    leaf by leaf).

    Returns (params, notes): notes say what was skipped (e.g. the vision tower). Tensors of the
    text model that the schema does not know raise, so a checkpoint is never half-read. `cast`
    only ever sees floating-point arrays (see `_Reader.read`).
    """
    plan = hf_plan(cfg, source, fp8_block)
    leaves = [plan.read(path, cast) for path in plan.paths()]
    return jax.tree_util.tree_unflatten(plan.treedef, leaves), plan.notes


def param_shapes(cfg: ModelConfig, num_mtp_layers: int = 0, legacy: bool = False) -> dict:
    """The params pytree's leaf shapes implied by the config (tuples as leaves).

    `params_from_hf` checks its result against this, so the two cannot drift apart; artifact
    loading uses it as the restore target. `legacy`: the [in, out] layout of linear weights
    that artifacts of format 2 and older stored.
    """
    h, v, d = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    hq, hkv, hv, dv = cfg.num_q_heads, cfg.num_kv_heads, cfg.linear_num_v_heads, cfg.linear_v_dim
    if cfg.variant == "dense":
        i = cfg.intermediate_size
        mlp = {"gate": (i, h), "up": (i, h), "down": (h, i)}
    else:
        e, i, s = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        mlp = {
            "router": (e, h),
            "experts": {"gate": (e, i, h), "up": (e, i, h), "down": (e, h, i)},
            "shared": {"gate": (s, h), "up": (s, h), "down": (h, s)},
            "shared_gate": (1, h),
        }
    norms = {"input_norm": (h,), "post_norm": (h,)}
    attention = {**norms, "mlp": mlp, "mixer": {
        "q": (hq * d * 2, h), "k": (hkv * d, h), "v": (hkv * d, h), "o": (h, hq * d),
        "q_norm": (d,), "k_norm": (d,)}}
    linear = {**norms, "mlp": mlp, "mixer": {
        "in_qkv": (cfg.conv_dim, h), "in_z": (hv * dv, h), "in_b": (hv, h), "in_a": (hv, h),
        "conv": (cfg.conv_kernel, cfg.conv_dim), "dt_bias": (hv,), "A_log": (hv,), "norm": (dv,),
        "out": (h, hv * dv)}}

    def stacked(tree, n):
        if n == 0:
            return {}
        return jax.tree.map(lambda s: (n, *s), tree, is_leaf=lambda x: isinstance(x, tuple))

    shapes = {
        "embed": (v, h),
        "final_norm": (h,),
        "linear": stacked(linear, cfg.num_linear_layers),
        "attention": stacked(attention, cfg.num_attention_layers),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (v, h)
    if cfg.vision is not None:
        shapes["vision"] = vision_param_shapes(cfg.vision)
    if num_mtp_layers:
        shapes["mtp"] = {"fc": (h, 2 * h), "embed_norm": (h,), "hidden_norm": (h,),
                         "final_norm": (h,), "layers": stacked(attention, num_mtp_layers)}
    if legacy:
        return _map_linear(shapes, lambda s: (*s[:-2], s[-1], s[-2]),
                           is_leaf=lambda x: isinstance(x, tuple))
    return shapes


# The linear weights' leaf names ([..., out, in]; the rest are embeddings, norms, conv, scalars).
LINEAR_LEAVES = frozenset({"q", "k", "v", "o", "in_qkv", "in_z", "in_b", "in_a", "out", "gate",
                           "up", "down", "router", "shared_gate", "fc", "lm_head"})


def _map_linear(tree: dict, fn: Callable, is_leaf=None) -> dict:
    """`tree` with `fn` applied to every linear weight leaf (by its last key)."""
    def one(path, leaf):
        return fn(leaf) if getattr(path[-1], "key", None) in LINEAR_LEAVES else leaf

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=is_leaf)


def from_legacy_layout(params: dict) -> dict:
    """Params with [in, out] linear weights (artifact format <= 2) in today's [out, in]."""
    return _map_linear(params, lambda a: np.ascontiguousarray(np.swapaxes(np.asarray(a), -1, -2)))


def check_param_shapes(cfg: ModelConfig, params: dict) -> None:
    """Raises a CheckpointError naming the first leaf whose path or shape is not the schema's."""
    num_mtp = len(params["mtp"]["layers"]["input_norm"]) if "mtp" in params else 0
    want = dict(jax.tree_util.tree_flatten_with_path(
        param_shapes(cfg, num_mtp), is_leaf=lambda x: isinstance(x, tuple))[0])
    got = {path: tuple(np.shape(a)) for path, a in
           jax.tree_util.tree_flatten_with_path(params, is_leaf=quant.is_quantized)[0]}
    for path in sorted(set(want) | set(got), key=str):
        name = jax.tree_util.keystr(path)
        if path not in got:
            raise CheckpointError(f"params are missing {name} (expected shape {want[path]})")
        if path not in want:
            raise CheckpointError(f"params have an unexpected leaf {name}")
        if got[path] != want[path]:
            raise CheckpointError(f"params leaf {name} has shape {got[path]}, expected {want[path]}")


def init_params(cfg: ModelConfig, key: jax.Array, dtype=np.float32, num_mtp_layers: int = 0,
                std: float = 0.02) -> dict:
    """Random params of the schema's shapes (training from scratch, benchmarks).

    Matrices ~ N(0, std); zero-centred norms 0 (identity); the GDN gated norm 1; `A_log` and
    `dt_bias` as transformers initialises them (A ~ U(1, 16), dt_bias 1).
    """
    import jax.numpy as jnp

    shapes = param_shapes(cfg, num_mtp_layers)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, shape), k in zip(flat, keys):
        name = jax.tree_util.keystr(path)
        last = name.rsplit("[", 1)[-1]
        if name.startswith("['vision']") and "norm" in last:  # LayerNorm: weight 1, bias 0
            leaf = jnp.ones(shape) if last.endswith("_w']") else jnp.zeros(shape)
        elif name.startswith("['vision']") and last.endswith("_b']"):
            leaf = jnp.zeros(shape)
        elif name.endswith("['A_log']"):
            leaf = jnp.log(jax.random.uniform(k, shape, minval=1.0, maxval=16.0))
        elif name.endswith(("['dt_bias']", "['mixer']['norm']")):
            leaf = jnp.ones(shape)
        elif "norm" in last:
            leaf = jnp.zeros(shape)
        else:
            leaf = std * jax.random.normal(k, shape)
        leaves.append(leaf.astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)
