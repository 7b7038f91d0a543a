"""The Engine's context store settings: from `Engine.open(context_store=...)` or the CLI flags
to a running `ContextTiers` (DESIGN §11).

Owns the default topology (a host-memory tier of DEFAULT_HOST_CACHE_GB), the shortcuts
(`host_cache_gb`, `disk_cache_dir`, `redis_url`: a pipe host -> disk -> Redis of those given),
what the Engine fills into a topology (every `cache` tier's `block_bytes`, which the model fixes,
and `capacity` from a `capacity_gb` field), and the model identity that block ids start from.
"""

from __future__ import annotations

import copy
import hashlib
import json
import pathlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from ninfer_jax.engine.blocks import BlockLayout
from ninfer_jax.engine.tiers import ContextTiers
from ninfer_jax.errors import ConfigError

DEFAULT_HOST_CACHE_GB = 1.0
OFF = "off"
_SAMPLE = 1 << 16  # elements of each weight tensor the model identity hashes


def topology(context_store: Any = None, *, host_cache_gb: float | None = None,
             disk_cache_dir: str | None = None,
             redis_url: str | None = None) -> dict | None:
    """The assembler dict for these settings; None when the store is off.

    context_store: None (the default host tier, or the shortcuts' pipe), "off", a topology
    dict (DESIGN §11 assembler format), or the path of a JSON file holding one. The shortcuts
    cannot be combined with a topology."""
    shortcuts = host_cache_gb is not None or disk_cache_dir is not None or redis_url is not None
    if context_store is not None and shortcuts:
        raise ConfigError("context_store and host_cache_gb/disk_cache_dir/redis_url are "
                          "exclusive: describe the whole topology in context_store")
    if context_store == OFF:
        return None
    if isinstance(context_store, (str, pathlib.Path)):
        return _read(pathlib.Path(context_store))
    if isinstance(context_store, Mapping):
        return copy.deepcopy(dict(context_store))
    if context_store is not None:
        raise ConfigError(f"context_store must be None, 'off', a dict or a JSON file path, got "
                          f"{type(context_store).__name__}")
    gb = DEFAULT_HOST_CACHE_GB if host_cache_gb is None else host_cache_gb
    if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not 0 <= gb < 1 << 20:
        raise ConfigError(f"host_cache_gb must be a number of GiB >= 0, got {gb!r:.40}")
    tiers = []
    if gb > 0:
        tiers.append({"store": "cache", "config": {"capacity_gb": gb}})
    if disk_cache_dir is not None:
        if not isinstance(disk_cache_dir, (str, pathlib.Path)) or not str(disk_cache_dir):
            raise ConfigError(f"disk_cache_dir must be a directory path, got {disk_cache_dir!r}")
        tiers.append({"store": "posix", "config": {"root": str(disk_cache_dir)}})
    if redis_url is not None:
        if not isinstance(redis_url, str) or not redis_url:
            raise ConfigError(f"redis_url must be a redis:// URL, got {redis_url!r}")
        tiers.append({"store": "redis", "config": {"url": redis_url}})
    return {"type": "pipe", "stores": tiers} if tiers else None


def _read(path: pathlib.Path) -> dict:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"context_store: cannot read {str(path)!r}: {e.strerror}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"context_store: {str(path)!r} is not a JSON file: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"context_store: {str(path)!r} must hold a JSON object (a topology)")
    return config


# Where each built-in store sits in a pipe: host memory above the local disk above a remote
# Redis (DESIGN §11: device -> host -> disk -> remote). Other stores may go anywhere.
_DEPTH = {"cache": 0, "posix": 1, "redis": 2}


def check_order(node: Any, where: str = "context_store") -> None:
    """Refuses a pipe whose built-in stores are not fastest first (a host-memory cache below
    the disk never serves a read the disk would not: it only adds a copy), naming both."""
    if not isinstance(node, dict):
        return
    for key in ("stores", "branches"):
        for i, child in enumerate(node.get(key) or []):
            check_order(child, f"{where}.{key}[{i}]")
    if node.get("type") != "pipe":
        return
    above: tuple[int, str] | None = None
    for i, child in enumerate(node.get("stores") or []):
        depth = _DEPTH.get(child.get("store")) if isinstance(child, dict) else None
        if depth is None:
            continue
        if above is not None and depth < _DEPTH[above[1]]:
            raise ConfigError(
                f"{where}.stores[{i}] is {child['store']!r} below {above[1]!r} "
                f"({where}.stores[{above[0]}]): a pipe runs from the fastest tier down "
                "(cache -> posix -> redis); list them in that order")
        above = (i, child["store"])


def fill(node: Any, block_bytes: int, where: str = "context_store") -> None:
    """Completes every `cache` tier of a topology in place: block_bytes (the model's page
    block; a different given value is an error) and capacity from capacity_gb."""
    if not isinstance(node, dict):
        return
    for key in ("stores", "branches"):
        for i, child in enumerate(node.get(key) or []):
            fill(child, block_bytes, f"{where}.{key}[{i}]")
    if node.get("store") != "cache" or not isinstance(node.get("config", {}), dict):
        return
    config = node.setdefault("config", {})
    given = config.setdefault("block_bytes", block_bytes)
    if given != block_bytes:
        raise ConfigError(f"{where}.config.block_bytes is {given!r}; this model's blocks are "
                          f"{block_bytes} bytes (leave it out)")
    if "capacity_gb" in config:
        gb = config.pop("capacity_gb")
        if "capacity" in config:
            raise ConfigError(f"{where}.config: give capacity (blocks) or capacity_gb, not both")
        if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not gb > 0:
            raise ConfigError(f"{where}.config.capacity_gb must be a number > 0, got {gb!r:.40}")
        config["capacity"] = max(1, int(gb * (1 << 30)) // block_bytes)


def model_identity(params: Any, config: Any, limits: Any, dtype: str) -> bytes:
    """What block ids start from: the model config, the weights (each tensor's name, shape,
    dtype and an evenly strided sample of up to 65,536 of its values: any retrained or
    fine-tuned weights differ there), dtype and the page layout."""
    import jax  # the Program's params are device arrays

    h = hashlib.blake2b(digest_size=32)
    h.update(repr(config).encode())
    h.update(json.dumps([dtype, limits.page_size, limits.page_bytes,
                         limits.checkpoint_state_bytes, limits.rewrites_below_frontier]).encode())
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    for path, leaf in sorted(leaves, key=lambda item: jax.tree_util.keystr(item[0])):
        flat = leaf.reshape(-1)
        sample = np.asarray(flat[:: max(1, flat.size // _SAMPLE)][:_SAMPLE])
        h.update(f"{jax.tree_util.keystr(path)}:{leaf.shape}:{leaf.dtype}".encode())
        h.update(np.ascontiguousarray(sample).tobytes())
    return h.digest()


def open_tiers(config: dict | None, program: Any, identity: bytes) -> ContextTiers | None:
    """A ContextTiers over `config` for this Program, or None when config is None."""
    from ninfer_jax.store import StoreAssembler, StoreError

    if config is None:
        return None
    lim = program.limits
    if not lim.total_checkpoint_slots or not lim.page_bytes:
        raise ConfigError("context_store needs prefix checkpoints (num_checkpoint_slots > 0)")
    layout = BlockLayout(identity, lim.page_size, lim.rewrites_below_frontier, lim.page_bytes,
                         lim.checkpoint_state_bytes)
    check_order(config)
    fill(config, layout.block_bytes)
    try:
        assembler = StoreAssembler(config)
    except StoreError as e:
        raise ConfigError(f"context_store: {e}") from None
    root = assembler.get_scheduler()
    # The stores, head first, for statistics and probes (none behind a peer's routing).
    tiers = list(getattr(root, "tiers", None) or filter(None, [getattr(root, "store", None)]))
    return ContextTiers(root, layout, tiers)
