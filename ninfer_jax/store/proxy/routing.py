"""Routing strategies for a StorePeer, registered by name (seed §6.5, §10.5).

A strategy is set up with its config dict and the peer's branch count, then `select(ctx)` maps a
request's facts to a branch index, always a valid one: a missing fact falls back to the last
branch. Built-ins:
- `ttl`: config `thresholds` (ms, strictly decreasing, one fewer than the branches); a request
  goes to the first branch whose threshold its `ttl_ms` exceeds, else (short or no TTL) the last.
- `length`: config `thresholds` (block counts, strictly increasing, one fewer than the branches);
  a request goes to the first branch whose threshold its `total_block_count` does not exceed,
  else (longer, or unknown length) the last.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from typing import Any

from ninfer_jax.store.config import get_int_list, reject_unknown, require_mapping
from ninfer_jax.store.errors import InvalidParam
from ninfer_jax.store.types import RequestContext


class RoutingStrategy(abc.ABC):
    @abc.abstractmethod
    def setup(self, config: Mapping[str, Any], num_branches: int) -> None: ...

    @abc.abstractmethod
    def select(self, ctx: RequestContext) -> int: ...


_STRATEGIES: dict[str, type[RoutingStrategy]] = {}


def register_strategy(name: str) -> Callable[[type[RoutingStrategy]], type[RoutingStrategy]]:
    def register(cls: type[RoutingStrategy]) -> type[RoutingStrategy]:
        if name in _STRATEGIES:
            raise InvalidParam(f"routing strategy {name!r} is already registered")
        _STRATEGIES[name] = cls
        return cls

    return register


def create_strategy(name: str, config: Mapping[str, Any], num_branches: int) -> RoutingStrategy:
    if name not in _STRATEGIES:
        raise InvalidParam(f"unknown routing strategy {name!r}; known: {sorted(_STRATEGIES)}")
    strategy = _STRATEGIES[name]()
    strategy.setup(require_mapping(config, f"routing {name!r}"), num_branches)
    return strategy


def _thresholds(config: Mapping[str, Any], num_branches: int, owner: str,
                decreasing: bool) -> list[int]:
    reject_unknown(config, ("thresholds",), owner)
    thresholds = get_int_list(config, "thresholds", owner)
    pairs = zip(thresholds, thresholds[1:])
    if not all((a > b) if decreasing else (a < b) for a, b in pairs):
        order = "decreasing" if decreasing else "increasing"
        raise InvalidParam(f"{owner}: thresholds must be strictly {order}, got {thresholds}")
    if len(thresholds) != num_branches - 1:
        raise InvalidParam(f"{owner}: {len(thresholds)} thresholds need {len(thresholds) + 1} "
                           f"branches, the peer has {num_branches}")
    return thresholds


@register_strategy("ttl")
class TtlStrategy(RoutingStrategy):
    def setup(self, config: Mapping[str, Any], num_branches: int) -> None:
        self._thresholds = _thresholds(config, num_branches, "routing 'ttl'", decreasing=True)

    def select(self, ctx: RequestContext) -> int:
        ttl_ms = getattr(ctx, "ttl_ms", None)
        if ttl_ms is not None:
            for i, threshold in enumerate(self._thresholds):
                if ttl_ms > threshold:
                    return i
        return len(self._thresholds)


@register_strategy("length")
class LengthStrategy(RoutingStrategy):
    def setup(self, config: Mapping[str, Any], num_branches: int) -> None:
        self._thresholds = _thresholds(config, num_branches, "routing 'length'", decreasing=False)

    def select(self, ctx: RequestContext) -> int:
        count = getattr(ctx, "total_block_count", None)
        if count is not None:
            for i, threshold in enumerate(self._thresholds):
                if count <= threshold:
                    return i
        return len(self._thresholds)
