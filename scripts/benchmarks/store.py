"""Store throughput and lookup latency, next to plain numpy and plain file baselines.

    python scripts/bench.py --suite=store

Measures, in one run, GB/s for dump and load through the `cache` (host memory) and `posix` stores
at 1 MiB and 16 MiB blocks, against a plain numpy copy and a plain file write(+fsync)/read of the
same bytes, plus the latency of a one-block lookup in a cache holding 1M blocks. Medians of
several repetitions.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

import numpy as np

from ninfer_jax.store import BlockId, BlockPayload, JobDescriptor, RequestContext
from ninfer_jax.store.memory import CacheStore
from ninfer_jax.store.posix import PosixStore

MIB = 1 << 20
REPS = 5
NUM_BLOCKS = {MIB: 64, 16 * MIB: 8}
LOOKUP_BLOCKS = 1_000_000


def _ids(n: int, salt: int) -> list[BlockId]:
    return [BlockId((salt * 10_000_000 + i).to_bytes(16, "little")) for i in range(n)]


def _median_gbps(fn, nbytes: int) -> float:
    times = []
    for rep in range(REPS):
        start = time.perf_counter()
        fn(rep)
        times.append(time.perf_counter() - start)
    return nbytes / statistics.median(times) / 1e9


def _store_pair(store, block_bytes: int, n: int, tokened: bool) -> tuple[float, float]:
    src = [np.random.default_rng(i).integers(0, 255, block_bytes, dtype=np.uint8)
           for i in range(n)]
    dst = [np.empty(block_bytes, np.uint8) for _ in range(n)]
    facet = store.as_token_addressed() if tokened else None

    def dump(rep: int) -> None:
        ids = _ids(n, rep)
        job = JobDescriptor(ids, [BlockPayload([s]) for s in src])
        if facet is None:
            store.dump(rep, job)
            store.wait([rep])
        else:
            token = facet.alloc(ids, RequestContext("bench"))
            facet.dump(rep, job, token)
            store.wait([rep])
            facet.commit(ids, True)

    def load(rep: int) -> None:
        ids = _ids(n, REPS - 1)  # the last dump's blocks are resident in every store
        job = JobDescriptor(ids, [BlockPayload([d]) for d in dst])
        if facet is None:
            store.load(100 + rep, job)
            assert store.wait([100 + rep])[0].success
        else:
            token = facet.pin(ids)
            facet.load(100 + rep, job, token)
            assert store.wait([100 + rep])[0].success
            facet.unpin(ids)

    dump(REPS + 1)  # warm-up: first touch of the slab and the directories
    dump_gbps = _median_gbps(dump, n * block_bytes)
    load_gbps = _median_gbps(load, n * block_bytes)
    return dump_gbps, load_gbps


def _baselines(block_bytes: int, n: int, root: str) -> dict[str, tuple[float, float]]:
    src = [np.random.default_rng(i).integers(0, 255, block_bytes, dtype=np.uint8)
           for i in range(n)]
    dst = [np.empty(block_bytes, np.uint8) for _ in range(n)]

    def copy(rep: int) -> None:
        for s, d in zip(src, dst):
            np.copyto(d, s)

    def write(rep: int) -> None:
        for i, s in enumerate(src):
            with open(os.path.join(root, f"{rep}_{i}"), "wb") as f:
                f.write(s)
                f.flush()
                os.fsync(f.fileno())

    def read(rep: int) -> None:
        for i, d in enumerate(dst):
            with open(os.path.join(root, f"{rep}_{i}"), "rb", buffering=0) as f:
                f.readinto(d)

    gbps = _median_gbps(copy, n * block_bytes)
    return {"numpy copy": (gbps, gbps),
            "file write+fsync/read": (_median_gbps(write, n * block_bytes),
                                      _median_gbps(read, n * block_bytes))}


def _lookup_latency_us() -> float:
    store = CacheStore()
    store.setup({"capacity": LOOKUP_BLOCKS, "block_bytes": 1})
    ids = _ids(LOOKUP_BLOCKS, 99)
    byte = np.zeros(1, np.uint8)
    for job, start in enumerate(range(0, LOOKUP_BLOCKS, 100_000)):
        chunk = ids[start : start + 100_000]
        store.dump(job, JobDescriptor(chunk, [BlockPayload([byte]) for _ in chunk]))
        assert store.wait([job])[0].success
    probe = ids[:: LOOKUP_BLOCKS // 1000]
    samples = []
    for _ in range(REPS):
        start = time.perf_counter()
        for block_id in probe:
            store.lookup([block_id])
        samples.append((time.perf_counter() - start) / len(probe))
    assert all(store.lookup(probe))
    store.close()
    return statistics.median(samples) * 1e6


def run(out_dir: str) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(dir=out_dir) as root:
        for block_bytes, n in NUM_BLOCKS.items():
            size = f"{block_bytes // MIB} MiB"
            for name, pair in _baselines(block_bytes, n, root).items():
                rows.append((name, size, *pair))
            cache = CacheStore()
            cache.setup({"capacity": n, "block_bytes": block_bytes, "num_threads": 2})
            rows.append(("cache store", size, *_store_pair(cache, block_bytes, n, True)))
            cache.close()
            posix = PosixStore()
            posix.setup({"root": os.path.join(root, f"posix{block_bytes}")})
            rows.append(("posix store", size, *_store_pair(posix, block_bytes, n, False)))
            posix.close()
    lookup_us = _lookup_latency_us()
    print(f"{'path':<24}{'block':>8}{'dump GB/s':>12}{'load GB/s':>12}")
    for name, size, dump, load in rows:
        print(f"{name:<24}{size:>8}{dump:>12.2f}{load:>12.2f}")
    print(f"lookup latency, 1 block among {LOOKUP_BLOCKS:,} resident: {lookup_us:.2f} us (median)")
    return {"rows": [dict(path=r[0], block=r[1], dump_gbps=r[2], load_gbps=r[3]) for r in rows],
            "lookup_us_1m_resident": lookup_us}
