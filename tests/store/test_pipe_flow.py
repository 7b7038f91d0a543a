"""A pipe driven as the engine drives it: a small `cache` head over `posix`, many blocks a request.

Through the StoreAssembler API only: a prefix lookup followed by prefetches converges to hits
that really load (the prefetch never evicts the prefix it completes), a put larger than the
head lands in the tier below, and finishing a request with an unconsumed job releases its pins
and reservations once the completion is consumed (G4, G11).
"""

import itertools

import numpy as np
import pytest

from ninfer_jax.store import InvalidParam, IoContext, NoSpace, StoreAssembler
from tests.store.helpers import (
    BLOCK_BYTES,
    block_data,
    empties,
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


# -- 2. a put larger than the head ----------------------------------------------------------------
def test_put_larger_than_the_head_lands_in_the_tier_below(tmp_path):
    node = pipe(tmp_path, capacity=2)
    register(node, "w")
    token = node.prepare_put("w", ids(*range(5)))
    node.submit_put(1, payloads(range(5)), token)
    node.store.jobs.wait_all_finished()
    with pytest.raises(InvalidParam, match="not been consumed"):
        node.complete_put("w")  # G4 holds for the blocks that went straight below too
    assert node.wait([1])[0].success
    node.complete_put("w")
    assert node.tiers[1].lookup(ids(*range(5))) == [True] * 5
    assert node.store.buffer.num_allocs() == 0 and not node.store.overflow_allocs
    register(node, "r")
    next_job = job_counter()
    for chunk in ([0, 1], [2, 3], [4]):
        last, lookups = prefix_with_prefetch(node, "r", ids(*chunk), next_job)
        assert last == len(chunk) - 1 and lookups <= 2
        get_blocks(node, "r", chunk, next_job())


def test_failed_put_larger_than_the_head_publishes_nothing_here(tmp_path):
    node = pipe(tmp_path, capacity=2)
    register(node, "w")
    node.prepare_put("w", ids(*range(4)))
    node.complete_put("w", success=False)  # no dump: nothing was written anywhere
    assert node.store.lookup(ids(*range(4))) == [False] * 4
    assert node.tiers[1].lookup(ids(*range(4))) == [False] * 4
    assert node.store.buffer.num_allocs() == 0 and not node.store.overflow_allocs


def test_put_larger_than_a_head_without_a_lower_tier_is_no_space_naming_the_limits():
    node = StoreAssembler({"type": "store", "store": "cache",
                           "config": {"capacity": 2, "block_bytes": BLOCK_BYTES}}).root
    register(node, "w")
    with pytest.raises(NoSpace, match=r"batch of 3 block\(s\).*capacity is 2"):
        node.prepare_put("w", ids(1, 2, 3))
    assert node.store.buffer.num_allocs() == 0
    put(node, "w", [1, 2], 1)  # the failed prepare opened nothing


# -- 3. a request finished while a job of its window is unconsumed --------------------------------
def test_finish_with_an_unconsumed_get_releases_the_pin_once_consumed(tmp_path):
    node = pipe(tmp_path, capacity=2)
    register(node, "w")
    put(node, "w", [1], 1)
    register(node, "r")
    outs = empties(1)
    node.submit_get(2, outs, node.prepare_get("r", ids(1)))
    node.store.jobs.wait_all_finished()
    node.on_request_finished("r")
    buf = node.store.buffer
    assert buf.pin_count(ids(1)[0]) == 1  # never released under an unconsumed transfer (G4)
    assert [r.job_id for r in node.get_finished()] == [2]
    assert buf.num_pins() == 0
    np.testing.assert_array_equal(outs[0].buffers[0], block_data(1))
    put(node, "w", [2, 3], 3)  # the block is evictable again
    assert node.store.lookup(ids(1, 2, 3)) == [False, True, True]


def test_finish_with_an_unconsumed_put_concludes_the_reservation_once_consumed(tmp_path):
    node = pipe(tmp_path, capacity=2)
    register(node, "r")
    node.submit_put(1, payloads([1, 2, 3]), node.prepare_put("r", ids(1, 2, 3)))
    node.store.jobs.wait_all_finished()
    node.on_request_finished("r")
    assert node.store.buffer.num_allocs() == 2 and len(node.store.overflow_allocs) == 1
    assert node.wait([1])[0].success
    assert node.store.buffer.num_allocs() == 0 and not node.store.overflow_allocs
    assert node.store.lookup(ids(1, 2)) == [False, False]  # a finished put is not published


def test_finish_with_an_unconsumed_prefetch_completes_the_plan_once_consumed(tmp_path):
    node = pipe(tmp_path, capacity=2)
    register(node, "w")
    put(node, "w", [1, 2], 1)
    put(node, "w", [3, 4], 2)
    register(node, "r")
    assert node.lookup_on_prefix("r", ids(1, 2)) is None
    node.submit_prefetch(3, node.prepare_prefetch("r"))
    node.store.jobs.wait_all_finished()
    node.on_request_finished("r")
    buf = node.store.buffer
    assert buf.num_allocs() == 2
    assert node.wait([3])[0].success
    assert buf.num_allocs() == 0 and buf.num_pins() == 0
    put(node, "w", [5, 6], 4)  # every slot can be reused
    assert node.store.lookup(ids(5, 6)) == [True, True]


def test_a_job_submitted_on_a_finished_requests_token_also_defers_the_release(tmp_path):
    node = pipe(tmp_path, capacity=2)
    register(node, "w")
    put(node, "w", [1], 1)
    register(node, "r")
    token = node.prepare_get("r", ids(1))
    node.submit_get(2, empties(1), token)
    node.on_request_finished("r")
    node.submit_get(3, empties(1), token)  # still pinned: the window's release is pending
    assert node.wait([2])[0].success
    assert node.store.buffer.pin_count(ids(1)[0]) == 1
    assert node.wait([3])[0].success
    assert node.store.buffer.num_pins() == 0
