"""Value types shared by every store and the proxy (DESIGN §11, seed §4).

Owns: `BlockId` (16-byte content hash), `BlockPayload` (the buffers of one block),
`AddressedToken` (keys + opaque payload), `RequestContext` (request facts), `JobDescriptor`,
`IoContext`/`IoResult`, and the conversion of "keys" (a list of BlockId or packed bytes) to ids.
Owns no behaviour beyond validation of these values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import numpy as np

from ninfer_jax.store.errors import InvalidParam

BLOCK_ID_BYTES = 16


@dataclasses.dataclass(frozen=True, order=True)
class BlockId:
    """A block's 16-byte content hash: one id means one content in every tier (G1)."""

    bytes: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.bytes, (bytes, bytearray)) or len(self.bytes) != BLOCK_ID_BYTES:
            raise InvalidParam(
                f"BlockId needs exactly {BLOCK_ID_BYTES} bytes, got {self.bytes!r}"
            )
        object.__setattr__(self, "bytes", bytes(self.bytes))

    def to_bytes(self) -> bytes:
        return self.bytes

    def hex(self) -> str:
        return self.bytes.hex()

    def __repr__(self) -> str:
        return f"BlockId({self.bytes.hex()})"


def as_block_ids(keys: Sequence[BlockId] | bytes | bytearray | memoryview) -> list[BlockId]:
    """Keys as an ordered list of ids; packed keys are 16 bytes per id, in request order."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        raw = bytes(keys)
        if len(raw) % BLOCK_ID_BYTES:
            raise InvalidParam(
                f"packed keys must be a multiple of {BLOCK_ID_BYTES} bytes, got {len(raw)}"
            )
        return [BlockId(raw[i : i + BLOCK_ID_BYTES]) for i in range(0, len(raw), BLOCK_ID_BYTES)]
    ids = list(keys)
    for i, key in enumerate(ids):
        if not isinstance(key, BlockId):
            raise InvalidParam(f"keys[{i}] must be a BlockId, got {type(key).__name__}")
    return ids


def require_unique(ids: Sequence[BlockId], what: str) -> None:
    """A batch names each block once; a repeated id is a caller error naming the id."""
    seen: set[BlockId] = set()
    for block_id in ids:
        if block_id in seen:
            raise InvalidParam(f"{what}: block {block_id.hex()} appears twice in one batch")
        seen.add(block_id)


def byte_view(buffer: Any) -> memoryview:
    """A flat, writable-if-possible uint8 view of a numpy array, bytearray or memoryview."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise InvalidParam(f"payload buffers must be C-contiguous, got strides {buffer.strides}")
        return memoryview(buffer.reshape(-1).view(np.uint8))
    view = memoryview(buffer)
    if not view.contiguous:
        raise InvalidParam("payload buffers must be contiguous")
    return view.cast("B")


@dataclasses.dataclass
class BlockPayload:
    """The memory of one block: one or more buffers (numpy arrays, bytearrays or memoryviews).

    On load the buffers are destinations, on dump sources; their sizes concatenate to the block.
    `memory_region_indices` and `group_sizes` are reserved for registered-memory transports.
    """

    buffers: list[Any] = dataclasses.field(default_factory=list)
    memory_region_indices: list[int] = dataclasses.field(default_factory=list)
    group_sizes: list[int] = dataclasses.field(default_factory=list)

    def views(self) -> list[memoryview]:
        return [byte_view(b) for b in self.buffers]

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views())


@dataclasses.dataclass(frozen=True)
class AddressedToken:
    """A self-addressed credential: `keys` are the blocks it covers, `payload` is opaque.

    Minted by pin/alloc/prepare_prefetch, consumed by load/dump/prefetch. Only a peer reads the
    payload (its frame); everyone else passes it through untouched.
    """

    keys: tuple[BlockId, ...]
    payload: bytes = b""

    def __post_init__(self) -> None:
        object.__setattr__(self, "keys", tuple(as_block_ids(self.keys)))
        object.__setattr__(self, "payload", bytes(self.payload))


@dataclasses.dataclass
class RequestContext:
    """Facts about a request, snapshotted when it is registered (G10).

    Consumers read the facts they know and ignore the rest, so a new fact is a new attribute
    (set freely on an instance) rather than a new parameter.
    """

    request_id: str | None = None
    ttl_ms: int | None = None
    total_block_count: int | None = None

    def validated(self) -> RequestContext:
        """A copy of this context (unknown facts included) after checking the known facts."""
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidParam(f"RequestContext.request_id must be a non-empty str, "
                               f"got {self.request_id!r}")
        for name in ("ttl_ms", "total_block_count"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise InvalidParam(f"RequestContext.{name} must be a non-negative int or None, "
                                   f"got {value!r}")
        snapshot = RequestContext(self.request_id, self.ttl_ms, self.total_block_count)
        snapshot.__dict__.update(
            {k: v for k, v in self.__dict__.items() if k not in snapshot.__dict__}
        )
        return snapshot


class Prerequisite(Protocol):
    """Something a transfer waits on before moving bytes, shaped like `threading.Event`.

    `wait(timeout)` returns True once fired, False when `timeout` seconds passed first; the store
    polls it, so closing the store never hangs on a prerequisite that never fires.
    """

    def wait(self, timeout: float | None = None) -> bool: ...


def check_prerequisite(prerequisite: Any, field: str) -> None:
    """A prerequisite must be None or offer `wait(timeout)`; anything else is InvalidParam."""
    if prerequisite is not None and not callable(getattr(prerequisite, "wait", None)):
        raise InvalidParam(f"{field} must be None or have wait(timeout) -> bool (like "
                           f"threading.Event), got {type(prerequisite).__name__}")


@dataclasses.dataclass
class JobDescriptor:
    """One transfer: `payloads[i]` is the destination (load) or source (dump) of `block_ids[i]`."""

    block_ids: list[BlockId]
    payloads: list[BlockPayload]
    description: str = ""
    prerequisite: Prerequisite | None = None

    def __post_init__(self) -> None:
        self.block_ids = as_block_ids(self.block_ids)
        if len(self.payloads) != len(self.block_ids):
            raise InvalidParam(f"job has {len(self.block_ids)} block ids but "
                               f"{len(self.payloads)} payloads")
        for i, payload in enumerate(self.payloads):
            if not isinstance(payload, BlockPayload):
                raise InvalidParam(f"payloads[{i}] must be a BlockPayload, "
                                   f"got {type(payload).__name__}")
        check_prerequisite(self.prerequisite, "JobDescriptor.prerequisite")


@dataclasses.dataclass
class IoContext:
    """Per-submit context for the worker: an optional prerequisite the transfer waits on."""

    prerequisite: Prerequisite | None = None

    def __post_init__(self) -> None:
        check_prerequisite(self.prerequisite, "IoContext.prerequisite")


@dataclasses.dataclass(frozen=True)
class IoResult:
    """One consumed completion: the job id and whether its transfer succeeded."""

    job_id: int
    success: bool


def ids_hex(ids: Iterable[BlockId]) -> str:
    """Short human form of a few ids for error messages."""
    ids = list(ids)
    shown = ", ".join(i.hex() for i in ids[:4])
    return shown + (f", ... ({len(ids)} total)" if len(ids) > 4 else "")
