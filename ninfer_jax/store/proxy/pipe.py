"""StorePipe: tiers chained head first (seed §6.4, G14).

The assembler sets the tiers up bottom-up, giving each the one below as `piped_lower_store`, so
the head sees configured tiers. The pipe is a StoreEntry over the head: cascading (write-through,
prefetch from below) is the head store's own behaviour through its lower tier, not the proxy's.
Teardown closes the head first, then each tier below it in order, since a tier holds the one below;
a second `close()` does nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from ninfer_jax.store.base import Store
from ninfer_jax.store.errors import InvalidParam
from ninfer_jax.store.lifecycle import Lifecycle
from ninfer_jax.store.proxy.entry import StoreEntry


class StorePipe(StoreEntry):
    def __init__(self, tiers: Sequence[Store]):
        if not tiers:
            raise InvalidParam("pipe: 'stores' must name at least one tier")
        super().__init__(tiers[0])
        self.tiers = list(tiers)
        self.life = Lifecycle("pipe", opened=True)

    def close(self) -> None:
        if self.life.close():
            for tier in self.tiers:
                tier.close()
