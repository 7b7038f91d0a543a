"""Shared test helpers: ids, payloads, a fake monotonic clock, small stores, time bounds."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from ninfer_jax.store import BlockId, BlockPayload, CacheBuffer
from ninfer_jax.store.memory import CacheStore

BLOCK_BYTES = 64


def bid(i: int) -> BlockId:
    return BlockId(i.to_bytes(16, "little"))


def ids(*numbers: int) -> list[BlockId]:
    return [bid(i) for i in numbers]


def block_data(i: int, nbytes: int = BLOCK_BYTES) -> np.ndarray:
    return (np.arange(nbytes, dtype=np.uint32) * 7 + i * 131).astype(np.uint8)


def payloads(numbers, nbytes: int = BLOCK_BYTES) -> list[BlockPayload]:
    return [BlockPayload([block_data(i, nbytes)]) for i in numbers]


def empties(n: int, nbytes: int = BLOCK_BYTES) -> list[BlockPayload]:
    return [BlockPayload([np.zeros(nbytes, np.uint8)]) for _ in range(n)]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def buffer(capacity: int = 4, policy: str = "lru", clock: FakeClock | None = None) -> CacheBuffer:
    return CacheBuffer(capacity, policy, clock or FakeClock())


def cache_store(capacity: int = 4, policy: str = "lru", clock=None, lower=None) -> CacheStore:
    store = CacheStore(clock or FakeClock())
    config = {"capacity": capacity, "policy": policy, "block_bytes": BLOCK_BYTES}
    if lower is not None:
        config["piped_lower_store"] = lower
    store.setup(config)
    return store


def admit(buf: CacheBuffer, numbers, ttl_ms=None) -> None:
    buf.reserve(ids(*numbers), ttl_ms)
    buf.commit(ids(*numbers), True)


def within(seconds: float, fn, *args):
    """fn(*args) run on a daemon thread; its result, its exception, or a test failure if it is
    still running after `seconds` (a hang must fail the test, not stall the suite)."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["result"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 (re-raised on the test's thread)
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        pytest.fail(f"{getattr(fn, '__name__', fn)} did not return within {seconds} s (hang)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("result")


def register(node, rid: str, ttl_ms=None) -> None:
    from ninfer_jax.store import RequestContext

    node.on_new_request(RequestContext(rid, ttl_ms))


def prefix_with_prefetch(node, rid: str, keys, next_job, max_lookups: int = 5):
    """The engine's loop: lookup_on_prefix, and while it signals, prefetch and look again.

    Returns (index of the last prefix hit, number of lookups); fails the test if the loop has
    not answered after `max_lookups` lookups (a loop that would never converge).
    """
    for lookups in range(1, max_lookups + 1):
        answer = node.lookup_on_prefix(rid, keys)
        if answer is not None:
            return answer, lookups
        plan = node.prepare_prefetch(rid)
        job = next_job()
        node.submit_prefetch(job, plan)
        assert node.wait([job])[0].success
        node.complete_prefetch(rid)
    pytest.fail(f"lookup_on_prefix still signals a prefetch after {max_lookups} lookups")


def get_blocks(node, rid: str, numbers, job: int) -> None:
    """Pins, loads and releases `numbers` through `node`; asserts their exact bytes."""
    token = node.prepare_get(rid, ids(*numbers))
    outs = empties(len(numbers))
    node.submit_get(job, outs, token)
    assert node.wait([job])[0].success
    node.complete_get(rid)
    for i, out in zip(numbers, outs):
        np.testing.assert_array_equal(out.buffers[0], block_data(i))
