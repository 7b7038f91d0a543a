"""Per-tensor digests and the finiteness check: what an artifact records at write, checks at load.

Owns the tensor naming of a params pytree (dotted paths, as orbax names its arrays:
`linear.mixer.in_qkv`) and the digest: sha256 of each 64 MiB chunk of the tensor's bytes (C
order, in its stored dtype), then sha256 of the concatenated chunk digests. The
chunks of every tensor hash on a thread pool (hashlib and numpy release the GIL), so a stacked
tensor of many GB does not hash on one core. Each chunk is also checked for NaN/inf in the same
pass. `Digest` computes the same digest from a tensor fed in pieces (streamed writes and reads).
Shape and dtype are recorded beside the digest, not inside it.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
from collections.abc import Iterable

import jax
import numpy as np

from ninfer_jax.errors import CheckpointError

ALGORITHM = "sha256 of 64 MiB chunks, then sha256 of the chunk digests"
CHUNK_BYTES = 64 << 20
FINITE_BYTES = 16 << 20  # `Digest` scans for NaN/inf this much at a time


def tensor_name(path: tuple) -> str:
    """A pytree path of dict keys (and a quantized weight's fields) as a dotted name."""
    return ".".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def named_leaves(tree, is_leaf=None) -> dict[str, object]:
    """{dotted name: leaf} of a nested dict pytree (empty subtrees have no leaves)."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    return {tensor_name(path): leaf for path, leaf in flat}


def _chunks(name: str, array: np.ndarray) -> Iterable[tuple[str, np.ndarray]]:
    flat = np.ascontiguousarray(array).reshape(-1)
    step = max(1, CHUNK_BYTES // max(1, flat.itemsize))
    if flat.size == 0:
        yield name, flat
    for start in range(0, flat.size, step):
        yield name, flat[start:start + step]


def _finite(chunk: np.ndarray) -> bool:
    if chunk.dtype.name == "bfloat16":
        # NaN/inf have every exponent bit set; on the bits this is twice ml_dtypes' isfinite.
        exponent = np.uint16(0x7F80)
        return not bool(((chunk.view(np.uint16) & exponent) == exponent).any())
    return bool(np.isfinite(chunk).all())


def _scan_chunk(item: tuple[str, np.ndarray], digest: bool) -> tuple[str, bytes, bool]:
    name, chunk = item
    finite = _finite(chunk)
    return name, hashlib.sha256(chunk.view(np.uint8)).digest() if digest else b"", finite


def scan(tensors: dict[str, np.ndarray], *,
         digest: bool = True) -> tuple[dict[str, str], list[str]]:
    """({name: hex digest} (empty when `digest` is False), names of the tensors holding NaN or
    inf), in one pass over the bytes."""
    items = [c for name, a in tensors.items() for c in _chunks(name, np.asarray(a))]
    workers = min(8, os.cpu_count() or 1, max(1, len(items)))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda item: _scan_chunk(item, digest), items))
    parts: dict[str, list[bytes]] = {name: [] for name in tensors}
    nonfinite: list[str] = []
    for name, part, finite in results:
        if not finite and name not in nonfinite:
            nonfinite.append(name)
        parts[name].append(part)
    sums = {name: hashlib.sha256(b"".join(p)).hexdigest() for name, p in parts.items()}
    return (sums if digest else {}), nonfinite


def all_finite(array: np.ndarray) -> bool:
    """Whether `array` holds no NaN/inf, scanned FINITE_BYTES at a time on this thread (the
    scan's temporaries stay that small; `scan`'s pool keeps freed chunks in its threads'
    malloc arenas)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    step = max(1, FINITE_BYTES // max(1, flat.itemsize))
    return all(_finite(flat[start:start + step]) for start in range(0, flat.size, step))


class Digest:
    """The digest and finiteness of one tensor fed in pieces (its C-order bytes in order, cut
    anywhere): the same digest `scan` gives for the whole tensor."""

    def __init__(self, dtype):
        itemsize = np.dtype(dtype).itemsize
        self._step = max(1, CHUNK_BYTES // max(1, itemsize)) * itemsize  # `_chunks`' cut
        self._parts: list[bytes] = []
        self._hash, self._filled = hashlib.sha256(), 0
        self.finite = True

    def update(self, piece: np.ndarray) -> None:
        flat = np.ascontiguousarray(piece).reshape(-1)
        self.finite = self.finite and all_finite(flat)
        data = memoryview(flat.view(np.uint8))
        while len(data):
            take = min(self._step - self._filled, len(data))
            self._hash.update(data[:take])
            self._filled += take
            data = data[take:]
            if self._filled == self._step:
                self._parts.append(self._hash.digest())
                self._hash, self._filled = hashlib.sha256(), 0

    def hexdigest(self) -> str:
        tail = [self._hash.digest()] if self._filled or not self._parts else []
        return hashlib.sha256(b"".join(self._parts + tail)).hexdigest()


def check_finite(tensors: dict[str, np.ndarray], where: str) -> None:
    """Raises a CheckpointError naming the first tensor (in `where`) holding NaN or inf."""
    _, nonfinite = scan(tensors, digest=False)
    if nonfinite:
        raise CheckpointError(f"tensor {nonfinite[0]!r} in {where} holds NaN or inf values")
