"""Tensor parallel: the `tp` device mesh and where every weight and pool lives on it.

Owns the layout of a Program over `ProgramConfig.tensor_parallel` devices (Megatron style, by
heads): attention q/k/v and the GDN input projections are split by output rows (whole heads per
device), o_proj and the GDN out_proj by input columns, the MLP's gate/up by rows and down by
columns, the MoE experts by their intermediate rows ("intermediate", the default) or whole
experts per device ("expert"), the embedding and the lm head by vocabulary rows. The K/V pages
are split by KV head and the GDN recurrent state by value head, so each device holds the state
of its own heads. A leaf whose split dimension the tp size does not divide (e.g. a single KV
head) is replicated; norms, routers, the MTP fc, the vision tower and a DFlash drafter are
replicated. The steps themselves are unchanged: XLA's SPMD partitioner inserts the collectives
from these placements, and every executable's outputs keep the inputs' placements, so donated
pools alias in place and nothing recompiles.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from ninfer_jax.errors import ConfigError
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.quant import QUANTIZED_LEAVES
from pallas_kernels.platform import TP_AXIS

AXIS = TP_AXIS

# Leaf name -> (dimension counted from the end, what that dimension counts). The dimension is
# split only if the tp size divides that count (and so the dimension).
_ROWS, _COLS = -2, -1
_ATTENTION = {"q": (_ROWS, "q_heads"), "k": (_ROWS, "kv_heads"), "v": (_ROWS, "kv_heads"),
              "o": (_COLS, "q_heads")}
_GDN = {"in_qkv": (_ROWS, "qkv_heads"), "conv": (_COLS, "qkv_heads"),
        "in_z": (_ROWS, "v_heads"), "in_b": (_ROWS, "v_heads"), "in_a": (_ROWS, "v_heads"),
        "dt_bias": (-1, "v_heads"), "A_log": (-1, "v_heads"), "out": (_COLS, "v_heads")}
_MLP = {"gate": (_ROWS, "rows"), "up": (_ROWS, "rows"), "down": (_COLS, "rows")}
_REPLICATED_TREES = ("vision", "dflash")


def tp_mesh(tensor_parallel: int) -> Mesh | None:
    """The 1-D `tp` mesh over the first `tensor_parallel` devices; None for 1 (no mesh: the
    Program runs on the default device as it always has)."""
    if tensor_parallel == 1:
        return None
    devices = jax.devices()
    if tensor_parallel > len(devices):
        hint = (" (on CPU, start the process with XLA_FLAGS="
                f"--xla_force_host_platform_device_count={tensor_parallel})"
                if jax.default_backend() == "cpu" else "")
        raise ConfigError(f"tensor_parallel {tensor_parallel} needs {tensor_parallel} devices; "
                          f"this process has {len(devices)}{hint}")
    return Mesh(np.array(devices[:tensor_parallel]), (AXIS,), axis_types=(AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def _counts(cfg: ModelConfig) -> dict[str, int]:
    qkv = np.gcd(cfg.linear_num_k_heads, cfg.linear_num_v_heads)
    return {"q_heads": cfg.num_q_heads, "kv_heads": cfg.num_kv_heads,
            "v_heads": cfg.linear_num_v_heads, "qkv_heads": int(qkv)}


def _split(ndim: int, dim: int) -> PartitionSpec:
    spec = [None] * ndim
    spec[dim] = AXIS
    return PartitionSpec(*spec)


def param_spec(path: tuple[str, ...], shape: tuple[int, ...], cfg: ModelConfig, tp: int,
               moe: str = "intermediate") -> PartitionSpec:
    """Where the params leaf at `path` (its dict keys, layer indices left out) is split."""
    if not path or path[0] in _REPLICATED_TREES or tp == 1:
        return PartitionSpec()
    counts, name = _counts(cfg), path[-1]
    parent = path[-2] if len(path) > 1 else ""
    if name in ("embed", "lm_head"):
        rule = (_ROWS, None)
    elif parent == "mixer":
        rule = _ATTENTION.get(name) or _GDN.get(name)  # the two mixers' names are distinct
    elif parent == "experts" and moe == "expert":
        rule = (-3, None)
    elif parent in ("mlp", "experts", "shared"):
        rule = _MLP.get(name)
    else:
        rule = None
    if rule is None:
        return PartitionSpec()
    dim, count = rule
    if shape[dim] % tp or (count in counts and counts[count] % tp):
        return PartitionSpec()
    return _split(len(shape), dim)


def _keys(path) -> tuple[str, ...]:
    return tuple(str(p.key) for p in path if isinstance(p, jax.tree_util.DictKey))


def param_shardings(params: dict, cfg: ModelConfig, mesh: Mesh,
                    moe: str = "intermediate") -> dict:
    """The NamedSharding of every params leaf (a pytree like `params`)."""
    tp = mesh.shape[AXIS]
    return jax.tree_util.tree_map_with_path(
        lambda path, a: NamedSharding(mesh, param_spec(_keys(path), tuple(a.shape), cfg, tp,
                                                       moe)), params)


def place_params(params: dict, cfg: ModelConfig, mesh: Mesh, dtype: str,
                 moe: str = "intermediate",
                 prepare: Callable[[dict], dict] = lambda p: p) -> dict:
    """`params` cast to `dtype` and placed by `param_shardings`, leaf by leaf (each is cast on
    the host and sent to its devices before the next; a leaf already placed so stays).
    `prepare`: applied to the tree before placement (the Program's per-layer unstacking)."""
    dt = jnp.dtype(dtype)

    def host(a):
        return a if isinstance(a, jax.Array) else np.asarray(a)

    tree = prepare(jax.tree.map(host, params))
    shardings = param_shardings(tree, cfg, mesh, moe)

    def put(path, a, sharding):
        # a quantized weight's values and scales (QArray fields) keep their dtypes
        want = a.dtype if isinstance(path[-1], jax.tree_util.GetAttrKey) else dt
        if isinstance(a, jax.Array):
            if a.dtype == want and a.sharding == sharding:
                return a
            return jax.device_put(a.astype(want), sharding)
        return jax.device_put(np.asarray(a, want), sharding)

    return jax.tree_util.tree_map_with_path(put, tree, shardings)


def placement(cfg: ModelConfig, mesh: Mesh, moe: str = "intermediate"
              ) -> Callable[[tuple[str, ...], np.ndarray], jax.Array]:
    """A `loader.load_params` placement: each leaf goes from the host straight to its devices,
    split by `param_spec` (no device ever holds a whole split leaf). A quantized weight's
    values and scales (paths ending in its QArray field) split as the weight does, each where
    its own dims divide."""
    tp = mesh.shape[AXIS]

    def put(path: tuple[str, ...], host: np.ndarray) -> jax.Array:
        path = tuple(path)
        if len(path) > 1 and path[-1] in ("q", "scale") and path[-2] in QUANTIZED_LEAVES:
            path = path[:-1]
        spec = param_spec(path, tuple(host.shape), cfg, tp, moe)
        return jax.device_put(host, NamedSharding(mesh, spec)).block_until_ready()

    return put


def pool_shardings(pools: Any, cfg: ModelConfig, mesh: Mesh) -> Any:
    """The NamedSharding of every pool (a pytree like the Pools): K/V pages and INT8 pages'
    scales by KV head, the GDN recurrent state by value head, the conv state by channel as the
    GDN in-projection."""
    tp, counts = mesh.shape[AXIS], _counts(cfg)
    by_head = {"k": (2, "kv_heads"), "v": (2, "kv_heads"), "k_scale": (2, "kv_heads"),
               "v_scale": (2, "kv_heads"),
               "conv": (-2, "qkv_heads"), "prov_conv": (-2, "qkv_heads"),
               "ck_conv": (-2, "qkv_heads"),
               "rec": (-3, "v_heads"), "prov_rec": (-3, "v_heads"), "ck_rec": (-3, "v_heads")}

    def one(path, a):
        name = path[-1].name if isinstance(path[-1], jax.tree_util.GetAttrKey) else ""
        rule = by_head.get(name)
        if rule is None or counts[rule[1]] % tp or a.shape[rule[0]] % tp:
            return replicated(mesh)
        return NamedSharding(mesh, _split(len(a.shape), rule[0]))

    return jax.tree_util.tree_map_with_path(one, pools)


def sharded_fraction(array: jax.Array) -> float:
    """The share of `array` one device holds (1 / tp for a split leaf, 1 if replicated)."""
    shard = array.addressable_shards[0].data
    return shard.size / array.size if array.size else 1.0
