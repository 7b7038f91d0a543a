"""A pipe driven as the engine drives it: a small `cache` head over `posix`, many blocks a request.

Through the StoreAssembler API only: a prefix lookup followed by prefetches converges to hits
that really load (the prefetch never evicts the prefix it completes).
"""

import itertools

import pytest

from ninfer_jax.store import IoContext, StoreAssembler
from tests.store.helpers import (
    BLOCK_BYTES,
    get_blocks,
    ids,
    payloads,
    prefix_with_prefetch,
    register,
)


def pipe(tmp_path, capacity, policy="lru"):
    return StoreAssembler({"type": "pipe", "stores": [
        {"store": "cache", "config": {"capacity": capacity, "policy": policy,
                                      "block_bytes": BLOCK_BYTES}},
        {"store": "posix", "config": {"root": str(tmp_path)}}]}).root


def put(node, rid, numbers, job):
    token = node.prepare_put(rid, ids(*numbers))
    node.submit_put(job, payloads(numbers), token, IoContext())
    assert node.wait([job])[0].success
    node.complete_put(rid)


def job_counter(start=100):
    return itertools.count(start).__next__


# -- 1. lookup -> prefetch -> lookup converges ----------------------------------------------------
@pytest.mark.parametrize("policy", ["lru", "fifo", "clock"])
def test_prefix_longer_than_the_head_answers_the_longest_servable_prefix(tmp_path, policy):
    node = pipe(tmp_path, capacity=4, policy=policy)
    register(node, "w")
    for j, chunk in enumerate([[0, 1, 2], [3, 4, 5], [6, 7]]):
        put(node, "w", chunk, j)
    register(node, "r")
    next_job = job_counter()
    last, lookups = prefix_with_prefetch(node, "r", ids(*range(8)), next_job)
    assert lookups <= 2 and last == 3  # the head holds 4 blocks: the prefix's first 4
    get_blocks(node, "r", range(last + 1), next_job())
    assert prefix_with_prefetch(node, "r", ids(*range(8)), next_job) == (3, 1)


def test_prefetch_never_evicts_the_prefix_hits_it_completes(tmp_path):
    node = pipe(tmp_path, capacity=4)
    register(node, "w")
    put(node, "w", [2, 3], 1)
    put(node, "w", [0, 1], 2)
    put(node, "w", [8, 9], 3)  # head: 0 1 8 9, with 0 and 1 the least recently used
    assert node.tiers[1].lookup(ids(2, 3)) == [True, True]
    register(node, "r")
    next_job = job_counter()
    last, lookups = prefix_with_prefetch(node, "r", ids(0, 1, 2, 3), next_job)
    assert (last, lookups) == (3, 2)
    get_blocks(node, "r", [0, 1, 2, 3], next_job())
    assert node.store.buffer.num_pins() == 0 and node.store.buffer.num_allocs() == 0


def test_prefix_lookup_spends_the_head_on_the_prefix_alone(tmp_path):
    node = pipe(tmp_path, capacity=4)
    register(node, "w")
    put(node, "w", [0, 2, 3], 1)
    put(node, "w", [10, 11, 12, 13], 2)  # head: 10..13; 0, 2, 3 only below
    register(node, "r")
    next_job = job_counter()
    last, lookups = prefix_with_prefetch(node, "r", ids(0, 9, 2, 3), next_job)  # 9: nowhere
    assert (last, lookups) == (0, 2)
    # Blocks 2 and 3 cannot extend the prefix past 9: fetching them would evict for nothing.
    assert node.store.lookup(ids(0, 2, 3, 11, 12, 13)) == [True, False, False, True, True, True]
    assert node.lookup("r", ids(0, 9, 2, 3)) is None  # a plain lookup still wants them all


def test_a_block_another_put_is_writing_is_a_miss_not_a_prefetch(tmp_path):
    node = pipe(tmp_path, capacity=4)
    register(node, "w")
    token = node.prepare_put("w", ids(5))
    node.submit_put(1, payloads([5]), token)
    node.store.jobs.wait_all_finished()  # written through below, not yet committed here
    assert node.tiers[1].lookup(ids(5)) == [True]
    register(node, "r")
    next_job = job_counter()
    assert prefix_with_prefetch(node, "r", ids(5), next_job) == (-1, 1)
    assert node.wait([1])[0].success
    node.complete_put("w")
    assert prefix_with_prefetch(node, "r", ids(5), next_job) == (0, 1)
    get_blocks(node, "r", [5], next_job())
