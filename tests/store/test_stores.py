"""The cache and posix stores: jobs, completions, safety rules, write-through, files (G2-G6)."""

import os
import threading

import numpy as np
import pytest

from ninfer_jax.store import (
    AddressedToken,
    BlockPayload,
    InvalidParam,
    IoResult,
    JobDescriptor,
    NotFound,
    OsApiError,
    RequestContext,
)
from ninfer_jax.store.posix import PosixStore
from tests.store.helpers import BLOCK_BYTES, block_data, cache_store, empties, ids, payloads


def posix_store(root):
    store = PosixStore()
    store.setup({"root": str(root)})
    return store


def dump_via_token(store, job, numbers):
    facet = store.as_token_addressed()
    token = facet.alloc(ids(*numbers), RequestContext("r"))
    facet.dump(job, JobDescriptor(ids(*numbers), payloads(numbers)), token)
    assert store.wait([job])[0].success
    facet.commit(ids(*numbers), True)


def test_cache_roundtrip_through_token_facet():
    store = cache_store()
    dump_via_token(store, 1, [1, 2])
    facet = store.as_token_addressed()
    token = facet.pin(ids(1, 2))
    outs = empties(2)
    facet.load(2, JobDescriptor(ids(1, 2), outs), token)
    assert store.wait([2])[0].success
    facet.unpin(ids(1, 2))
    for i, out in zip([1, 2], outs):
        np.testing.assert_array_equal(out.buffers[0], block_data(i))
    store.close()


def test_cache_multi_buffer_payloads_concatenate():
    store = cache_store()
    halves = [np.arange(32, dtype=np.uint8), np.arange(32, 64, dtype=np.uint8)]
    store.dump(1, JobDescriptor(ids(1), [BlockPayload(halves)]))
    store.wait([1])
    out = [np.zeros(16, np.uint8), np.zeros(48, np.uint8)]
    store.load(2, JobDescriptor(ids(1), [BlockPayload(out)]))
    assert store.wait([2])[0].success
    np.testing.assert_array_equal(np.concatenate(out), np.arange(64, dtype=np.uint8))


def test_cache_rejects_wrong_block_size_naming_the_block():
    store = cache_store()
    with pytest.raises(InvalidParam, match="block_bytes is 64"):
        store.dump(1, JobDescriptor(ids(1), [BlockPayload([np.zeros(10, np.uint8)])]))
    assert store.lookup(ids(1)) == [False]


@pytest.mark.parametrize("config,field", [({}, "capacity"),
                                          ({"capacity": 2}, "block_bytes"),
                                          ({"capacity": 2, "block_bytes": 8, "policy": "mru"},
                                           "policy"),
                                          ({"capacity": 2, "block_bytes": 8, "x": 1}, "x"),
                                          ({"capacity": 2, "block_bytes": 8,
                                            "piped_lower_store": 3}, "piped_lower_store"),
                                          # #41: a MemoryError before
                                          ({"capacity": 10**12, "block_bytes": 8},
                                           "capacity 1000000000000 x block_bytes 8")])
def test_cache_config_errors_name_the_field(config, field):
    from ninfer_jax.store.memory import CacheStore

    with pytest.raises(InvalidParam, match=field):
        CacheStore().setup(config)


def test_completion_consumed_exactly_once():
    store = cache_store()
    store.dump(1, JobDescriptor(ids(1), payloads([1])))
    assert store.wait([1]) == [IoResult(1, True)]
    with pytest.raises(NotFound, match="job id 1"):
        store.wait([1])
    assert store.get_finished() == []


def test_get_finished_drains_every_completion_once():
    store = cache_store()
    for j in range(3):
        store.dump(j, JobDescriptor(ids(j), payloads([j])))
    store.jobs.wait_all_finished()
    assert sorted(r.job_id for r in store.get_finished()) == [0, 1, 2]
    assert store.get_finished() == []


def test_duplicate_in_flight_job_id_is_invalid():
    store = cache_store()
    gate = threading.Event()
    store.dump(1, JobDescriptor(ids(1), payloads([1]), prerequisite=gate))
    with pytest.raises(InvalidParam, match="job id 1 is already in flight"):
        store.dump(1, JobDescriptor(ids(2), payloads([2])))
    gate.set()
    store.wait([1])
    store.dump(1, JobDescriptor(ids(2), payloads([2])))  # reusable once consumed
    store.wait([1])


def test_wait_on_unknown_job_is_not_found():
    with pytest.raises(NotFound, match="job id 42"):
        cache_store().wait([42])


def test_submit_returns_before_the_transfer_and_waits_on_prerequisite():
    store = cache_store()
    gate = threading.Event()
    store.dump(1, JobDescriptor(ids(1), payloads([1]), prerequisite=gate))
    assert store.get_finished() == []
    assert store.jobs.num_running() == 1
    gate.set()
    assert store.wait([1])[0].success


def test_failed_transfer_reports_success_false():
    store = cache_store()
    dump_via_token(store, 1, [1])
    facet = store.as_token_addressed()
    token = facet.pin(ids(1))
    read_only = BlockPayload([np.frombuffer(bytes(BLOCK_BYTES), np.uint8)])
    facet.load(2, JobDescriptor(ids(1), [read_only]), token)
    assert store.wait([2])[0].success is False


def test_commit_false_refused_until_dump_consumed():
    store = cache_store()
    facet = store.as_token_addressed()
    token = facet.alloc(ids(1), None)
    facet.dump(1, JobDescriptor(ids(1), payloads([1])), token)
    store.jobs.wait_all_finished()
    with pytest.raises(InvalidParam, match="not been consumed"):
        facet.commit(ids(1), False)
    store.wait([1])
    facet.commit(ids(1), False)
    assert store.lookup(ids(1)) == [False]


def test_unpin_refused_while_load_unconsumed():
    store = cache_store()
    dump_via_token(store, 1, [1])
    facet = store.as_token_addressed()
    token = facet.pin(ids(1))
    facet.load(2, JobDescriptor(ids(1), empties(1)), token)
    store.jobs.wait_all_finished()
    with pytest.raises(InvalidParam, match="unpin"):
        facet.unpin(ids(1))
    store.wait([2])
    facet.unpin(ids(1))


def test_unpin_by_another_pinner_is_allowed_while_load_in_flight():
    store = cache_store()
    dump_via_token(store, 1, [1])
    facet = store.as_token_addressed()
    token = facet.pin(ids(1))
    facet.pin(ids(1))
    facet.load(2, JobDescriptor(ids(1), empties(1)), token)
    facet.unpin(ids(1))  # the other pin still guards the slot
    store.wait([2])


def test_commit_true_without_a_successful_dump_publishes_nothing():
    store = cache_store()
    facet = store.as_token_addressed()
    facet.alloc(ids(1), None)
    facet.commit(ids(1), True)
    assert store.lookup(ids(1)) == [False]


def test_load_requires_pin_and_dump_requires_alloc():
    store = cache_store()
    dump_via_token(store, 1, [1])
    facet = store.as_token_addressed()
    with pytest.raises(InvalidParam, match="unpinned"):
        facet.load(5, JobDescriptor(ids(1), empties(1)), _token(1))
    with pytest.raises(InvalidParam, match="without an outstanding alloc"):
        facet.dump(6, JobDescriptor(ids(2), payloads([2])), _token(2))
    with pytest.raises(InvalidParam, match="do not match"):
        facet.dump(7, JobDescriptor(ids(2), payloads([2])), _token(3))


def _token(i):
    return AddressedToken(tuple(ids(i)))


def test_pin_and_alloc_are_atomic_on_the_store():
    store = cache_store(capacity=2)
    dump_via_token(store, 1, [1])
    facet = store.as_token_addressed()
    with pytest.raises(NotFound):
        facet.pin(ids(1, 9))
    assert store.buffer.pin_count(ids(1)[0]) == 0
    facet.pin(ids(1))
    with pytest.raises(Exception):
        facet.alloc(ids(2, 3), None)
    assert store.buffer.pending_ids() == set()


def test_write_through_keeps_evicted_blocks_readable_below(tmp_path):
    lower = posix_store(tmp_path)
    store = cache_store(capacity=1, lower=lower)
    dump_via_token(store, 1, [1])
    dump_via_token(store, 2, [2])  # evicts 1 from the cache
    assert store.lookup(ids(1)) == [False]
    assert lower.lookup(ids(1, 2)) == [True, True]
    pf = store.as_prefetchable()
    assert pf.lookup("r", ids(1)) is None  # the prefetch signal, not an error
    plan = pf.prepare_prefetch("r", RequestContext("r", 1000))
    pf.prefetch(3, plan)
    with pytest.raises(InvalidParam, match="not consumed"):
        pf.complete_prefetch(plan, True)
    assert store.wait([3])[0].success
    pf.complete_prefetch(plan, True)
    assert pf.lookup("r", ids(1)) == [True]


def test_prefetched_blocks_inherit_the_window_ttl(tmp_path):
    from tests.store.helpers import FakeClock

    clock = FakeClock()
    store = cache_store(capacity=1, clock=clock, lower=posix_store(tmp_path))
    dump_via_token(store, 1, [1])
    dump_via_token(store, 2, [2])
    pf = store.as_prefetchable()
    assert pf.lookup("r", ids(1)) is None
    plan = pf.prepare_prefetch("r", RequestContext("r", 500))
    pf.prefetch(3, plan)
    store.wait([3])
    pf.complete_prefetch(plan, True)
    clock.advance(0.6)
    assert store.lookup(ids(1)) == [False]


def test_prepare_prefetch_without_signal_is_invalid(tmp_path):
    store = cache_store(lower=posix_store(tmp_path))
    with pytest.raises(InvalidParam, match="no pending prefetch signal"):
        store.as_prefetchable().prepare_prefetch("r", RequestContext("r"))


def test_failed_prefetch_job_commits_nothing(tmp_path):
    lower = posix_store(tmp_path)
    store = cache_store(capacity=1, lower=lower)
    dump_via_token(store, 1, [1])
    dump_via_token(store, 2, [2])
    pf = store.as_prefetchable()
    assert pf.lookup("r", ids(1)) is None
    plan = pf.prepare_prefetch("r", RequestContext("r"))
    os.truncate(lower.path_of(ids(1)[0]), 40)  # the source rots meanwhile
    pf.prefetch(3, plan)
    assert store.wait([3])[0].success is False
    pf.complete_prefetch(plan, True)
    assert store.lookup(ids(1)) == [False]


def test_cache_without_lower_is_not_prefetchable():
    assert cache_store().as_prefetchable() is None


# -- posix --------------------------------------------------------------------------------------
def test_posix_roundtrip_and_restart(tmp_path):
    store = posix_store(tmp_path)
    store.dump(1, JobDescriptor(ids(1, 2), payloads([1, 2], 1000)))
    assert store.wait([1])[0].success
    store.close()
    again = posix_store(tmp_path)
    assert again.lookup(ids(1, 2, 3)) == [True, True, False]
    outs = empties(2, 1000)
    again.load(2, JobDescriptor(ids(1, 2), outs))
    assert again.wait([2])[0].success
    np.testing.assert_array_equal(outs[1].buffers[0], block_data(2, 1000))


def test_posix_is_untokened(tmp_path):
    store = posix_store(tmp_path)
    assert store.as_token_addressed() is None and store.as_prefetchable() is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "foreign", "empty"])
def test_posix_corrupt_file_is_a_miss_and_quarantined(tmp_path, damage):
    store = posix_store(tmp_path)
    store.dump(1, JobDescriptor(ids(1, 2), payloads([1, 2])))
    store.wait([1])
    path = store.path_of(ids(1)[0])
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(raw[:-3])
    elif damage == "flip":
        raw[-1] ^= 0xFF
        path.write_bytes(raw)
    elif damage == "foreign":
        path.write_bytes(store.path_of(ids(2)[0]).read_bytes())
    else:
        path.write_bytes(b"")
    out = empties(1)
    store.load(2, JobDescriptor(ids(1), out))
    assert store.wait([2])[0].success is False
    assert not out[0].buffers[0].any() or damage == "flip"
    assert store.lookup(ids(1)) == [False]
    assert len(store.quarantined()) == 1


def test_posix_missing_block_load_fails(tmp_path):
    store = posix_store(tmp_path)
    store.load(1, JobDescriptor(ids(1), empties(1)))
    assert store.wait([1])[0].success is False


def test_posix_clears_temp_leftovers_at_setup(tmp_path):
    posix_store(tmp_path).close()
    (tmp_path / "tmp" / "junk.tmp").write_bytes(b"half")
    store = posix_store(tmp_path)
    left = [p.name for p in (tmp_path / "tmp").iterdir()]
    assert len(left) == 1 and left[0].endswith(".lock")  # only the live store's writer lock
    store.close()
    assert list((tmp_path / "tmp").iterdir()) == []


def test_posix_unwritable_root_is_os_api_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    with pytest.raises(OsApiError, match=str(blocker)):
        posix_store(blocker / "sub")


@pytest.mark.parametrize("config,field", [({}, "root"), ({"root": "/tmp/x", "n": 1}, "n"),
                                          ({"root": "/tmp/x", "piped_lower_store": 1},
                                           "'piped_lower_store' must be a Store")])
def test_posix_config_errors(config, field):
    with pytest.raises(InvalidParam, match=field):
        PosixStore().setup(config)
