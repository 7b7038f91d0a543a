"""StoreAssembler: builds a topology from a dict (seed §6.7, §10.6).

    node   := {type: "store", store: <name|module:Class>, config?: {...}}
            | {type: "pipe",  stores: [store node, ...]}        # non-empty, stores only
            | {type: "peer",  branches: [store|pipe node, ...], # a branch is never a peer
                              routing: {strategy: <name>, config?: {...}}}

Inside a pipe, `type` may be omitted (it can only be "store"). Pipes are set up bottom-up with
`piped_lower_store` injected; the assembler reads only the routing strategy's name, the strategy
reads its own config. Any failure closes whatever was already built and fails the whole assembly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ninfer_jax.store.base import Store
from ninfer_jax.store.config import require_mapping
from ninfer_jax.store.errors import InvalidParam
from ninfer_jax.store.proxy.api import StoreNode
from ninfer_jax.store.proxy.entry import StoreEntry
from ninfer_jax.store.proxy.loader import load_store
from ninfer_jax.store.proxy.peer import StorePeer
from ninfer_jax.store.proxy.pipe import StorePipe
from ninfer_jax.store.proxy.routing import create_strategy

_TYPES = ("store", "pipe", "peer")


class StoreAssembler:
    def __init__(self, config: Mapping[str, Any]):
        self._built: list[Store] = []
        try:
            self.root = self._node(config, "root")
        except Exception:
            for store in reversed(self._built):
                store.close()
            raise

    def get_scheduler(self) -> StoreNode:
        return self.root

    def get_worker(self) -> StoreNode:
        return self.root

    def close(self) -> None:
        self.root.close()

    def _node(self, config: Any, where: str) -> StoreNode:
        config = require_mapping(config, where)
        kind = config.get("type")
        if kind == "store":
            return StoreEntry(self._store(config, where, lower=None))
        if kind == "pipe":
            return self._pipe(config, where)
        if kind == "peer":
            return self._peer(config, where)
        raise InvalidParam(f"{where}: unknown node type {kind!r}; known: {list(_TYPES)}")

    def _store(self, config: Mapping[str, Any], where: str, lower: Store | None) -> Store:
        unknown = sorted(set(config) - {"type", "store", "config"})
        if unknown:
            raise InvalidParam(f"{where}: unknown field(s) {unknown} in a store node")
        store = load_store(config.get("store"))
        setup_config = dict(require_mapping(config.get("config", {}), f"{where}.config"))
        if lower is not None:
            setup_config["piped_lower_store"] = lower
        store.setup(setup_config)
        self._built.append(store)
        return store

    def _pipe(self, config: Mapping[str, Any], where: str) -> StorePipe:
        members = config.get("stores")
        if not isinstance(members, list) or not members:
            raise InvalidParam(f"{where}: a pipe needs a non-empty 'stores' list")
        tiers: list[Store] = []
        lower = None
        for i in range(len(members) - 1, -1, -1):
            member = require_mapping(members[i], f"{where}.stores[{i}]")
            if member.get("type", "store") != "store":
                raise InvalidParam(f"{where}.stores[{i}]: pipe tiers must be stores, got type "
                                   f"{member.get('type')!r}")
            lower = self._store(member, f"{where}.stores[{i}]", lower)
            tiers.insert(0, lower)
        return StorePipe(tiers)

    def _peer(self, config: Mapping[str, Any], where: str) -> StorePeer:
        branches = config.get("branches")
        if not isinstance(branches, list) or not branches:
            raise InvalidParam(f"{where}: a peer needs a non-empty 'branches' list")
        nodes = []
        for i, branch in enumerate(branches):
            branch = require_mapping(branch, f"{where}.branches[{i}]")
            if branch.get("type") == "peer":
                raise InvalidParam(f"{where}.branches[{i}]: a peer cannot be a branch of a "
                                   "peer; flatten it into a wider peer")
            nodes.append(self._node(branch, f"{where}.branches[{i}]"))
        routing = require_mapping(config.get("routing"), f"{where}.routing")
        strategy = create_strategy(routing.get("strategy"), routing.get("config", {}),
                                   len(nodes))
        return StorePeer(nodes, strategy)
