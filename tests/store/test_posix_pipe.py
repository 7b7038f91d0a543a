"""The posix store as a middle tier: host memory -> local disk -> Redis (and other tiers below),
driven through the StorePipe/StoreEntry API with real files and a real Redis server. Every call
that could wait on a tier is time-bounded: a hang fails the test."""

import itertools
import os

import numpy as np
import pytest

from ninfer_jax.store import (
    InvalidParam,
    JobDescriptor,
    OsApiError,
    RequestContext,
    StoreAssembler,
)
from ninfer_jax.store.posix import PosixStore
from ninfer_jax.testing.redis_server import RedisServer
from tests.store.helpers import BLOCK_BYTES, block_data, empties, ids, payloads, within

BOUND_S = 10.0
JOBS = itertools.count(1000)
REQUESTS = itertools.count()


@pytest.fixture(scope="module")
def server():
    with RedisServer() as started:
        yield started


@pytest.fixture
def url(server):
    server.client().flushdb()
    return server.url


def cache_node(capacity=2):
    return {"store": "cache", "config": {"capacity": capacity, "block_bytes": BLOCK_BYTES}}


def posix_node(root, **config):
    return {"store": "posix", "config": {"root": str(root), **config}}


def redis_node(url):
    return {"store": "redis", "config": {"url": url, "socket_timeout_s": 2.0}}


def assemble(*stores):
    return StoreAssembler({"type": "pipe", "stores": list(stores)}).root


def three_tiers(tmp_path, url):
    """cache (2 blocks) -> posix -> redis, the topology of DESIGN §11."""
    return assemble(cache_node(), posix_node(tmp_path / "disk"), redis_node(url))


def write(node, number):
    """Puts one block in its own request; the put's success."""
    rid = f"w{next(REQUESTS)}"
    node.on_new_request(RequestContext(rid))
    try:
        token = node.prepare_put(rid, ids(number))
        job = next(JOBS)
        node.submit_put(job, payloads([number]), token)
        ok = within(BOUND_S, node.wait, [job])[0].success
        node.complete_put(rid, ok)
        return ok
    finally:
        node.on_request_finished(rid)


def read(node, numbers):
    """The engine's read path: lookup -> (None -> prefetch cycle -> lookup) -> get.

    Returns (whether the first lookup signalled, the blocks read or None for a miss)."""
    keys, rid = ids(*numbers), f"r{next(REQUESTS)}"
    node.on_new_request(RequestContext(rid))
    try:
        hits = within(BOUND_S, node.lookup, rid, keys)
        signalled = hits is None
        if signalled:
            plan = node.prepare_prefetch(rid)
            job = next(JOBS)
            node.submit_prefetch(job, plan)
            ok = within(BOUND_S, node.wait, [job])[0].success
            node.complete_prefetch(rid, ok)
            hits = within(BOUND_S, node.lookup, rid, keys)
        if hits is None or not all(hits):
            return signalled, None
        token = node.prepare_get(rid, keys)
        outs, job = empties(len(keys)), next(JOBS)
        node.submit_get(job, outs, token)
        ok = within(BOUND_S, node.wait, [job])[0].success
        node.complete_get(rid)
        return signalled, [out.buffers[0] for out in outs] if ok else None
    finally:
        node.on_request_finished(rid)


def assert_blocks(blocks, numbers):
    assert blocks is not None, "a miss where the blocks are stored below"
    for block, number in zip(blocks, numbers, strict=True):
        np.testing.assert_array_equal(block, block_data(number))


def standalone_posix(root):
    """A second posix store on the same root, with no tier below: what the disk alone holds."""
    store = PosixStore()
    store.setup({"root": str(root)})
    return store


def evict_from_cache(node, numbers):
    """Writes two fresh blocks so the 2-slot cache drops every block of `numbers`."""
    for fresh in (90, 91):
        assert write(node, fresh)
    assert node.tiers[0].lookup(ids(*numbers)) == [False] * len(numbers)


def flip_data_byte(path):
    with open(path, "r+b") as f:
        f.seek(40)  # past the 36-byte header
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 0xFF]))


# -- dumps -----------------------------------------------------------------------------------
def test_a_dump_lands_in_every_tier(tmp_path, url, server):
    node = three_tiers(tmp_path, url)
    try:
        cache, posix, redis = node.tiers
        assert write(node, 1) and write(node, 2)
        assert cache.lookup(ids(1, 2)) == [True, True]
        assert all(posix.path_of(b).is_file() for b in ids(1, 2))
        assert all(server.client().exists(redis.key_of(b)) for b in ids(1, 2))
        disk = standalone_posix(tmp_path / "disk")
        outs = empties(2)
        disk.load(1, JobDescriptor(ids(1, 2), outs))
        assert within(BOUND_S, disk.wait, [1])[0].success
        assert_blocks([o.buffers[0] for o in outs], [1, 2])
        disk.close()
    finally:
        node.close()


# -- reads -----------------------------------------------------------------------------------
def test_a_block_evicted_from_the_cache_comes_back_from_posix(tmp_path, url, server):
    node = three_tiers(tmp_path, url)
    try:
        assert write(node, 1) and write(node, 2)
        evict_from_cache(node, [1, 2])
        server.client().delete(*[node.tiers[2].key_of(b) for b in ids(1, 2)])  # disk only now
        signalled, blocks = read(node, [1, 2])
        assert signalled
        assert_blocks(blocks, [1, 2])
        assert node.tiers[0].lookup(ids(1, 2)) == [True, True]
    finally:
        node.close()


def test_a_block_only_in_redis_comes_up_two_levels_and_is_rewritten_to_disk(tmp_path, url):
    node = three_tiers(tmp_path, url)
    try:
        posix = node.tiers[1]
        assert write(node, 1) and write(node, 2)
        evict_from_cache(node, [1, 2])
        for block_id in ids(1, 2):
            posix.path_of(block_id).unlink()
        assert standalone_posix(tmp_path / "disk").lookup(ids(1, 2)) == [False, False]
        signalled, blocks = read(node, [1, 2])
        assert signalled
        assert_blocks(blocks, [1, 2])
        disk = standalone_posix(tmp_path / "disk")  # the rewritten files verify on their own
        assert disk.lookup(ids(1, 2)) == [True, True]
        disk.close()
    finally:
        node.close()


def test_a_corrupted_disk_file_falls_back_to_redis_or_misses(tmp_path, url, server):
    node = three_tiers(tmp_path, url)
    try:
        posix, redis = node.tiers[1], node.tiers[2]
        for number in (1, 2):
            assert write(node, number)
        evict_from_cache(node, [1, 2])
        flip_data_byte(posix.path_of(ids(1)[0]))
        signalled, blocks = read(node, [1])
        assert signalled
        assert_blocks(blocks, [1])
        assert len(posix.quarantined()) == 1
        flip_data_byte(posix.path_of(ids(2)[0]))
        server.client().delete(redis.key_of(ids(2)[0]))
        assert read(node, [2]) == (False, None)  # a miss, never wrong bytes
    finally:
        node.close()


def test_a_disk_file_rotting_between_lookup_and_read_is_read_from_redis(tmp_path, url):
    node = three_tiers(tmp_path, url)
    try:
        posix = node.tiers[1]
        assert write(node, 1)
        evict_from_cache(node, [1])
        rid = "rot"
        node.on_new_request(RequestContext(rid))
        assert node.lookup(rid, ids(1)) is None  # the disk file verified: a prefetch signal
        plan = node.prepare_prefetch(rid)
        flip_data_byte(posix.path_of(ids(1)[0]))
        node.submit_prefetch(1, plan)
        assert within(BOUND_S, node.wait, [1])[0].success
        node.complete_prefetch(rid)
        node.on_request_finished(rid)
        assert len(posix.quarantined()) == 1
        signalled, blocks = read(node, [1])
        assert not signalled  # the prefetch brought it up from Redis, not from the rotten file
        assert_blocks(blocks, [1])
    finally:
        node.close()


# -- a failing tier below --------------------------------------------------------------------
def test_a_dead_redis_fails_dumps_cleanly_and_lookups_raise_or_miss(tmp_path):
    with RedisServer() as dying:
        node = three_tiers(tmp_path, dying.url)
        try:
            cache, posix = node.tiers[0], node.tiers[1]
            assert write(node, 1) and write(node, 2) and write(node, 3)  # 1 left the cache
            dying.process.kill()
            dying.process.wait()
            assert write(node, 4) is False
            assert cache.lookup(ids(4)) == [False]
            assert not posix.path_of(ids(4)[0]).exists(), "a failed write-through left a file"
            signalled, blocks = read(node, [1])  # the disk still serves what it holds
            assert signalled
            assert_blocks(blocks, [1])
            with pytest.raises(OsApiError, match=dying.url):
                read(node, [4])
        finally:
            within(BOUND_S, node.close)


# -- other tiers below -----------------------------------------------------------------------
def test_a_cache_below_the_disk_serves_as_any_tier_would(tmp_path):
    node = assemble(cache_node(), posix_node(tmp_path), cache_node(capacity=8))
    try:
        posix, bottom = node.tiers[1], node.tiers[2]
        assert write(node, 1) and write(node, 2)
        assert bottom.lookup(ids(1, 2)) == [True, True]
        evict_from_cache(node, [1, 2])
        posix.path_of(ids(1)[0]).unlink()
        signalled, blocks = read(node, [1, 2])
        assert signalled
        assert_blocks(blocks, [1, 2])
        assert posix.path_of(ids(1)[0]).is_file()
        assert [bottom.buffer.pin_count(b) for b in ids(1, 2)] == [0, 0], "a pin below leaked"
    finally:
        node.close()


def test_the_disk_as_head_without_block_bytes_reads_through(tmp_path, url):
    node = assemble(posix_node(tmp_path), redis_node(url))
    try:
        assert node.tiers[0].as_prefetchable() is None
        assert write(node, 1)
        node.tiers[0].path_of(ids(1)[0]).unlink()
        signalled, blocks = read(node, [1])
        assert not signalled  # no facet: the base lookup reports the block below as a hit
        assert_blocks(blocks, [1])
        assert node.tiers[0].path_of(ids(1)[0]).is_file()
    finally:
        node.close()


# -- the prefetch facet (posix with block_bytes and a tier below) ----------------------------
def test_the_disk_prefetches_from_any_depth(tmp_path, url, server):
    node = assemble(posix_node(tmp_path / "a", block_bytes=BLOCK_BYTES),
                    posix_node(tmp_path / "b"), redis_node(url))
    try:
        head, middle = node.tiers[0], node.tiers[1]
        assert write(node, 1) and write(node, 2)
        assert server.client().exists(node.tiers[2].key_of(ids(1)[0]))
        for tier in (head, middle):
            tier.path_of(ids(1)[0]).unlink()
        head.path_of(ids(2)[0]).unlink()
        signalled, blocks = read(node, [1, 2])
        assert signalled
        assert_blocks(blocks, [1, 2])
        for root in ("a", "b"):
            disk = standalone_posix(tmp_path / root)
            assert disk.lookup(ids(1, 2)) == [True, True]
            disk.close()
    finally:
        node.close()


def test_a_prefetch_pins_a_tokened_tier_below_until_it_completes(tmp_path):
    node = assemble(posix_node(tmp_path, block_bytes=BLOCK_BYTES), cache_node(capacity=4))
    try:
        posix, bottom = node.tiers
        assert write(node, 1)
        posix.path_of(ids(1)[0]).unlink()
        node.on_new_request(RequestContext("p"))
        assert node.lookup("p", ids(1)) is None
        plan = node.prepare_prefetch("p")
        assert bottom.buffer.pin_count(ids(1)[0]) == 1
        node.submit_prefetch(1, plan)
        with pytest.raises(InvalidParam, match="not consumed yet"):
            node.complete_prefetch("p")  # G4: its job has not been consumed
        assert node.wait([1])[0].success
        node.complete_prefetch("p")
        assert bottom.buffer.pin_count(ids(1)[0]) == 0
        assert node.lookup("p", ids(1)) == [True]
        node.on_request_finished("p")
        assert posix.path_of(ids(1)[0]).is_file()
    finally:
        node.close()


def test_block_bytes_is_enforced_at_submit(tmp_path):
    node = assemble(posix_node(tmp_path, block_bytes=BLOCK_BYTES), cache_node())
    try:
        with pytest.raises(InvalidParam, match=f"block_bytes is {BLOCK_BYTES}"):
            node.tiers[0].dump(1, JobDescriptor(ids(1), payloads([1], BLOCK_BYTES + 1)))
        assert not os.path.exists(node.tiers[0].path_of(ids(1)[0]))
    finally:
        node.close()


@pytest.mark.parametrize("config,message", [
    ({"piped_lower_store": 3}, "'piped_lower_store' must be a Store, got int"),
    ({"block_bytes": 0}, "'block_bytes' must be >= 1"),
])
def test_config_errors_name_the_field(tmp_path, config, message):
    with pytest.raises(InvalidParam, match=message):
        PosixStore().setup({"root": str(tmp_path), **config})
