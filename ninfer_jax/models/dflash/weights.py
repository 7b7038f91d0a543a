"""The drafter's weight schema: the public DFlash checkpoint's tensor names <-> params.

One table (`hf_names`) maps every tensor of the layout (`fc.weight`, `hidden_norm.weight`,
`norm.weight`, `layers.{i}.self_attn.*`, `layers.{i}.mlp.*`, the DFlash2
`layers.{i}.{attention,mlp}_conv.*` and `candidate_selector.*`) onto a params leaf; loading,
saving and the shapes all read it, so the three cannot disagree. The params:

    {"fc": [H, F*H], "hidden_norm": [H], "norm": [H],
     "layers": ({"input_norm", "post_norm": [H], "q": [Hq*D, H], "k", "v": [Hkv*D, H],
                 "o": [H, Hq*D], "q_norm", "k_norm": [D], "gate", "up": [I, H], "down": [H, I],
                 "attn_conv", "mlp_conv": {"base": [2, ks, H], "proj": [2*ks*G, H]}}, ...),
     "selector": {"pred", "succ": [V, r], "proj": [r, H]}}

Linear weights keep nn.Linear's [out, in]. Norms are Qwen3's plain RMSNorm weights (x * w).
The drafter has no embedding or lm head of its own: it uses the target's. Knows nothing of
files: tensors come through a `TensorSource`.
"""

from __future__ import annotations

import jax
import numpy as np

from ninfer_jax.errors import CheckpointError
from ninfer_jax.models.dflash.config import DFlashConfig
from ninfer_jax.models.qwen3_6.weights import FLOAT_DTYPES, TensorSource

# The official layout stores the codebooks without ".weight"; a model saved by transformers'
# nn.Embedding adds it. Both load.
_CODEBOOK_ALIASES = {"candidate_selector.predecessor_codebook",
                     "candidate_selector.successor_codebook"}


def hf_names(cfg: DFlashConfig) -> dict[str, tuple[tuple, tuple[int, ...]]]:
    """HF tensor name -> (params path, shape), for every tensor of the config's layout."""
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hq, hkv = cfg.num_q_heads * d, cfg.num_kv_heads * d
    names: dict[str, tuple[tuple, tuple[int, ...]]] = {
        "fc.weight": (("fc",), (h, cfg.num_features * h)),
        "hidden_norm.weight": (("hidden_norm",), (h,)),
        "norm.weight": (("norm",), (h,)),
    }
    for n in range(cfg.num_layers):
        pre = f"layers.{n}."
        layer = {
            "input_layernorm.weight": ("input_norm", (h,)),
            "post_attention_layernorm.weight": ("post_norm", (h,)),
            "self_attn.q_proj.weight": ("q", (hq, h)),
            "self_attn.k_proj.weight": ("k", (hkv, h)),
            "self_attn.v_proj.weight": ("v", (hkv, h)),
            "self_attn.o_proj.weight": ("o", (h, hq)),
            "self_attn.q_norm.weight": ("q_norm", (d,)),
            "self_attn.k_norm.weight": ("k_norm", (d,)),
            "mlp.gate_proj.weight": ("gate", (i, h)),
            "mlp.up_proj.weight": ("up", (i, h)),
            "mlp.down_proj.weight": ("down", (h, i)),
        }
        for name, (leaf, shape) in layer.items():
            names[pre + name] = (("layers", n, leaf), shape)
        if cfg.has_conv:
            ks, groups = cfg.conv_kernel_size, h // cfg.conv_group_size
            for conv in ("attention_conv", "mlp_conv"):
                key = "attn_conv" if conv == "attention_conv" else "mlp_conv"
                names[f"{pre}{conv}.base_kernel"] = (("layers", n, key, "base"), (2, ks, h))
                names[f"{pre}{conv}.kernel_projection.weight"] = (
                    ("layers", n, key, "proj"), (2 * ks * groups, h))
    if cfg.has_selector:
        r, v = cfg.selector_rank, cfg.vocab_size
        names["candidate_selector.predecessor_codebook"] = (("selector", "pred"), (v, r))
        names["candidate_selector.successor_codebook"] = (("selector", "succ"), (v, r))
        names["candidate_selector.hidden_projection.weight"] = (("selector", "proj"), (r, h))
    return names


def _set(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _freeze_layers(tree: dict, cfg: DFlashConfig) -> dict:
    tree["layers"] = tuple(tree["layers"][n] for n in range(cfg.num_layers))
    return tree


def param_shapes(cfg: DFlashConfig) -> dict:
    """The params pytree with shape tuples as leaves."""
    tree: dict = {}
    for path, shape in hf_names(cfg).values():
        _set(tree, path, shape)
    return _freeze_layers(tree, cfg)


def params_from_hf(cfg: DFlashConfig, source: TensorSource) -> dict:
    """Reads every tensor of the layout (shape- and dtype-checked, never cast); a missing,
    misshapen, non-float or unexpected tensor raises a `CheckpointError` naming it."""
    keys = set(source.keys())
    tree: dict = {}
    used = set()
    for name, (path, shape) in hf_names(cfg).items():
        stored = name
        if name not in keys and name in _CODEBOOK_ALIASES and f"{name}.weight" in keys:
            stored = f"{name}.weight"
        if stored not in keys:
            raise CheckpointError(f"missing drafter tensor {name!r}")
        arr = source.get(stored)
        if arr.dtype.name not in FLOAT_DTYPES:
            raise CheckpointError(f"drafter tensor {stored!r} has dtype {arr.dtype.name}, "
                                  f"expected a floating-point weight; it is not cast")
        if tuple(arr.shape) != shape:
            raise CheckpointError(
                f"drafter tensor {stored!r} has shape {tuple(arr.shape)}, expected {shape}")
        _set(tree, path, arr)
        used.add(stored)
    extra = sorted(keys - used)
    if extra:
        raise CheckpointError(f"unexpected drafter tensors (not in the config's layout): "
                              f"{extra[:5]}{' ...' if len(extra) > 5 else ''}")
    return _freeze_layers(tree, cfg)


def params_to_hf(cfg: DFlashConfig, params: dict) -> dict[str, np.ndarray]:
    """The params as the official layout's tensors (name -> array)."""
    out = {}
    for name, (path, _) in hf_names(cfg).items():
        leaf = params
        for key in path:
            leaf = leaf[key]
        out[name] = np.asarray(leaf)
    return out


def init_params(cfg: DFlashConfig, key: jax.Array, dtype=np.float32, std: float = 0.02) -> dict:
    """Random params: matrices ~ N(0, std), norms 1, conv base kernels ~ N(0, std)."""
    import jax.numpy as jnp

    shapes = param_shapes(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple) and all(isinstance(n, int) for n in x))
    keys = jax.random.split(key, len(flat))
    leaves = []
    for (path, shape), k in zip(flat, keys):
        last = str(path[-1].key) if hasattr(path[-1], "key") else ""
        leaf = jnp.ones(shape) if "norm" in last else std * jax.random.normal(k, shape)
        leaves.append(leaf.astype(dtype))
    return jax.tree_util.tree_unflatten(treedef, leaves)
