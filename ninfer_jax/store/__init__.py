"""The context store (DESIGN §11): blocks of prefix state moving between tiers.

Pure Python + numpy; imports no jax. The engine programs against `StoreScheduler` (control plane)
and `StoreWorker` (data plane), both obtained from a `StoreAssembler` built from a dict.
"""

from ninfer_jax.store.base import Prefetchable, Store, TokenAddressed
from ninfer_jax.store.cache_buffer import CacheBuffer, Reservation
from ninfer_jax.store.errors import (
    ErrorCode,
    General,
    InvalidParam,
    NoSpace,
    NotFound,
    OsApiError,
    StoreError,
)
from ninfer_jax.store.policies import create_policy, register_policy
from ninfer_jax.store.policy import ReplacementPolicy
from ninfer_jax.store.proxy.api import StoreNode, StoreScheduler, StoreWorker
from ninfer_jax.store.proxy.assembler import StoreAssembler
from ninfer_jax.store.proxy.entry import StoreEntry
from ninfer_jax.store.proxy.loader import load_store, register_store
from ninfer_jax.store.proxy.peer import StorePeer
from ninfer_jax.store.proxy.pipe import StorePipe
from ninfer_jax.store.proxy.routing import RoutingStrategy, register_strategy
from ninfer_jax.store.types import (
    AddressedToken,
    BlockId,
    BlockPayload,
    IoContext,
    IoResult,
    JobDescriptor,
    RequestContext,
)

__all__ = [
    "AddressedToken", "BlockId", "BlockPayload", "CacheBuffer", "ErrorCode", "General",
    "InvalidParam", "IoContext", "IoResult", "JobDescriptor", "NoSpace", "NotFound", "OsApiError",
    "Prefetchable", "ReplacementPolicy", "RequestContext", "Reservation", "RoutingStrategy",
    "Store", "StoreAssembler", "StoreEntry", "StoreError", "StoreNode", "StorePeer", "StorePipe",
    "StoreScheduler", "StoreWorker", "TokenAddressed", "create_policy", "load_store",
    "register_policy", "register_store", "register_strategy",
]
