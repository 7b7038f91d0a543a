"""CacheBuffer: visibility, atomic batches, shared reservations, rollback, TTL (G2-G4, G7-G9)."""

import pytest

from ninfer_jax.store import CacheBuffer, InvalidParam, NoSpace, NotFound, create_policy
from tests.store.helpers import FakeClock, admit, bid, buffer, ids


def test_reservation_is_invisible_until_commit():
    buf = buffer()
    buf.reserve(ids(1))
    assert buf.lookup(ids(1)) == [False]
    with pytest.raises(NotFound):
        buf.pin(ids(1))
    buf.commit(ids(1), True)
    assert buf.lookup(ids(1)) == [True]


def test_failed_commit_leaves_no_trace():
    buf = buffer()
    buf.reserve(ids(1, 2))
    buf.commit(ids(1, 2), False)
    assert buf.lookup(ids(1, 2)) == [False, False] and buf.num_free_slots() == 4


def test_policy_instance_can_be_injected():
    buf = CacheBuffer(2, create_policy("fifo", 2), FakeClock())
    assert buf.capacity == 2


def test_evictees_are_reported():
    buf = buffer(capacity=2)
    admit(buf, [1, 2])
    res = buf.reserve(ids(3))
    assert res.evicted == (bid(1),) and buf.lookup(ids(1)) == [False]
    assert buf.evictions == 1


def test_evictions_of_a_rolled_back_reservation_are_not_counted():
    buf = buffer(capacity=3)
    admit(buf, [1, 2, 3])
    buf.pin(ids(3))
    with pytest.raises(NoSpace):  # 4 and 5 evict 1 and 2, then 6 finds no slot
        buf.reserve(ids(4, 5, 6))
    assert buf.evictions == 0 and buf.lookup(ids(1, 2)) == [True, True]


def test_pin_is_atomic():
    buf = buffer()
    admit(buf, [1])
    with pytest.raises(NotFound, match=bid(2).hex()):
        buf.pin(ids(1, 2))
    assert buf.pin_count(bid(1)) == 0


def test_unpin_is_idempotent():
    buf = buffer()
    admit(buf, [1])
    buf.pin(ids(1))
    buf.unpin(ids(1))
    buf.unpin(ids(1))
    buf.unpin(ids(9))
    assert buf.pin_count(bid(1)) == 0


def test_pinned_blocks_are_never_evicted():
    buf = buffer(capacity=2)
    admit(buf, [1, 2])
    buf.pin(ids(1, 2))
    with pytest.raises(NoSpace, match="2 slots are pinned or reserved"):
        buf.reserve(ids(3))
    assert buf.lookup(ids(1, 2)) == [True, True]


def test_reserved_blocks_are_never_evicted():
    buf = buffer(capacity=2)
    buf.reserve(ids(1, 2))
    with pytest.raises(NoSpace):
        buf.reserve(ids(3))


def test_failed_reserve_rolls_back_victims_in_place_with_deadlines():
    clock = FakeClock()
    buf = buffer(capacity=3, clock=clock)
    admit(buf, [1], ttl_ms=5000)
    admit(buf, [2, 3])
    buf.pin(ids(3))
    slots = {b: buf.slot_of(b) for b in ids(1, 2)}
    with pytest.raises(NoSpace):
        buf.reserve(ids(4, 5, 6))  # evicts 1 and 2, then finds nothing for 6
    assert buf.lookup(ids(1, 2, 3, 4, 5)) == [True, True, True, False, False]
    assert {b: buf.slot_of(b) for b in ids(1, 2)} == slots
    clock.advance(5.0)
    assert buf.lookup(ids(1, 2)) == [False, True]  # the victim's deadline came back too


def test_failed_reserve_returns_shared_references():
    buf = buffer(capacity=2)
    buf.reserve(ids(1))
    admit(buf, [2])
    buf.pin(ids(2))
    with pytest.raises(NoSpace):
        buf.reserve(ids(1, 3))
    assert buf.alloc_refs(bid(1)) == 1


def test_failed_reserve_releases_readmission_pins():
    buf = buffer(capacity=2)
    admit(buf, [1, 2])
    buf.pin(ids(2))
    with pytest.raises(NoSpace):
        buf.reserve(ids(1, 3))  # 1 is readmitted (pinned), leaving nothing for 3
    assert buf.alloc_refs(bid(1)) == 0
    assert buf.reserve(ids(3)).evicted == (bid(1),)  # 1 is evictable again


def test_batch_never_evicts_its_own_members():
    buf = buffer(capacity=2)
    admit(buf, [1, 2])  # 1 is the LRU victim
    res = buf.reserve(ids(3, 1))
    assert res.evicted == (bid(2),)
    assert bid(1) not in res.evicted


@pytest.mark.parametrize("order", [[1, 3], [3, 1]])
def test_outcome_does_not_depend_on_batch_order(order):
    buf = buffer(capacity=2)
    admit(buf, [1, 2])
    res = buf.reserve(ids(*order))
    assert res.evicted == (bid(2),)
    buf.commit(ids(*order), True)
    assert buf.committed_ids() == set(ids(1, 3))


def test_shared_reservation_last_commit_decides_any_success_commits():
    buf = buffer()
    a = buf.reserve(ids(1))
    b = buf.reserve(ids(1))
    assert a.slots == b.slots and buf.alloc_refs(bid(1)) == 2
    buf.commit(ids(1), True)
    assert buf.lookup(ids(1)) == [False]  # not decided yet
    buf.commit(ids(1), False)
    assert buf.lookup(ids(1)) == [True]


def test_shared_reservation_all_failures_release():
    buf = buffer()
    buf.reserve(ids(1))
    buf.reserve(ids(1))
    buf.commit(ids(1), False)
    buf.commit(ids(1), False)
    assert buf.lookup(ids(1)) == [False] and buf.num_free_slots() == 4


def test_commit_without_alloc_is_invalid_and_atomic():
    buf = buffer()
    buf.reserve(ids(1))
    with pytest.raises(InvalidParam, match=bid(2).hex()):
        buf.commit(ids(1, 2), True)
    assert buf.alloc_refs(bid(1)) == 1


def test_duplicate_ids_in_a_batch_are_invalid():
    buf = buffer()
    for op in (buf.reserve, buf.pin):
        with pytest.raises(InvalidParam, match="twice"):
            op(ids(1, 1))


def test_readmission_keeps_slot_and_survives_pressure():
    buf = buffer(capacity=2)
    admit(buf, [1, 2])
    slot = buf.slot_of(bid(1))
    assert buf.reserve(ids(1)).slots == (slot,)
    assert buf.lookup(ids(1)) == [True]  # stays visible while rewritten
    assert buf.reserve(ids(3)).evicted == (bid(2),)  # 1 is guarded
    buf.commit(ids(1), False)
    assert buf.lookup(ids(1)) == [True]  # a failed rewrite leaves it as it was


def test_ttl_lazy_expiry_at_lookup():
    clock = FakeClock()
    buf = buffer(clock=clock)
    admit(buf, [1], ttl_ms=1000)
    clock.advance(0.999)
    assert buf.lookup(ids(1)) == [True]
    clock.advance(0.001)
    assert buf.lookup(ids(1)) == [False]
    assert buf.num_free_slots() == 4


def test_ttl_expiry_at_pin_and_touch():
    clock = FakeClock()
    buf = buffer(clock=clock)
    admit(buf, [1, 2], ttl_ms=1000)
    clock.advance(2)
    with pytest.raises(NotFound):
        buf.pin(ids(1))
    buf.touch(ids(2), ttl_ms=10_000)  # an expired block is not extended
    assert buf.lookup(ids(2)) == [False]


def test_touch_extends_never_shortens():
    clock = FakeClock()
    buf = buffer(clock=clock)
    admit(buf, [1], ttl_ms=1000)
    clock.advance(0.5)
    buf.touch(ids(1), ttl_ms=2000)
    buf.touch(ids(1), ttl_ms=10)
    clock.advance(1.9)
    assert buf.lookup(ids(1)) == [True]
    clock.advance(0.2)
    assert buf.lookup(ids(1)) == [False]


def test_touch_refreshes_lru_heat():
    buf = buffer(capacity=2)
    admit(buf, [1, 2])
    buf.touch(ids(1))
    assert buf.reserve(ids(3)).evicted == (bid(2),)


def test_no_ttl_means_no_expiry():
    clock = FakeClock()
    buf = buffer(clock=clock)
    admit(buf, [1])
    clock.advance(1e9)
    assert buf.lookup(ids(1)) == [True]


def test_pinned_expired_block_is_deferred_then_freed_on_unpin():
    clock = FakeClock()
    buf = buffer(clock=clock)
    admit(buf, [1], ttl_ms=1000)
    buf.pin(ids(1))
    clock.advance(5)
    assert buf.lookup(ids(1)) == [False]
    assert buf.sweep_expired() == []  # deferred: the slot is still pinned
    assert buf.num_free_slots() == 3
    buf.unpin(ids(1))
    assert buf.num_free_slots() == 4


def test_sweep_under_pressure_prefers_expired_blocks():
    clock = FakeClock()
    buf = buffer(capacity=2, clock=clock)
    admit(buf, [1])
    admit(buf, [2], ttl_ms=100)
    buf.touch(ids(1))
    clock.advance(1)
    res = buf.reserve(ids(3))
    assert res.evicted == () and buf.lookup(ids(1)) == [True]


def test_sweep_frees_deferred_entries_once_unpinned_by_readmission_end():
    clock = FakeClock()
    buf = buffer(clock=clock)
    admit(buf, [1], ttl_ms=100)
    buf.reserve(ids(1))  # re-admission pins the slot
    clock.advance(1)
    assert buf.sweep_expired() == []
    assert buf.lookup(ids(1)) == [False]
    buf.commit(ids(1), False)
    assert buf.num_free_slots() == 4


def test_successful_recommit_revives_an_expired_block():
    clock = FakeClock()
    buf = buffer(clock=clock)
    admit(buf, [1], ttl_ms=1000)
    buf.reserve(ids(1), ttl_ms=5000)
    clock.advance(2)
    assert buf.lookup(ids(1)) == [False]  # expired while re-admitted
    buf.commit(ids(1), True)
    assert buf.lookup(ids(1)) == [True]
    clock.advance(4.9)
    assert buf.lookup(ids(1)) == [True]
    clock.advance(0.2)
    assert buf.lookup(ids(1)) == [False]


def test_failed_recommit_lets_an_expired_block_go():
    clock = FakeClock()
    buf = buffer(clock=clock)
    admit(buf, [1], ttl_ms=1000)
    buf.reserve(ids(1))
    clock.advance(2)
    buf.commit(ids(1), False)
    assert buf.lookup(ids(1)) == [False] and buf.num_free_slots() == 4


def test_recommit_of_live_block_keeps_its_deadline():
    clock = FakeClock()
    buf = buffer(clock=clock)
    admit(buf, [1], ttl_ms=1000)
    buf.reserve(ids(1), ttl_ms=60_000)
    buf.commit(ids(1), True)
    clock.advance(1.5)
    assert buf.lookup(ids(1)) == [False]  # retention is extended only by touch


def test_shared_reservation_ttl_is_last_writer_wins():
    clock = FakeClock()
    buf = buffer(clock=clock)
    buf.reserve(ids(1), ttl_ms=100)
    buf.reserve(ids(1), ttl_ms=10_000)
    buf.commit(ids(1), True)
    buf.commit(ids(1), True)
    clock.advance(1)
    assert buf.lookup(ids(1)) == [True]


def test_heap_is_compacted_when_stale_items_dominate():
    clock = FakeClock()
    buf = buffer(capacity=2, clock=clock)
    admit(buf, [1], ttl_ms=1000)
    for i in range(500):
        buf.touch(ids(1), ttl_ms=2000 + i)
    assert buf.num_heap_items() <= 2 * 1 + 64 + 1


@pytest.mark.parametrize("policy", ["lru", "clock", "fifo"])
def test_every_policy_fills_and_evicts_consistently(policy):
    buf = buffer(capacity=3, policy=policy)
    for i in range(10):
        admit(buf, [i])
        assert len(buf.committed_ids()) == min(i + 1, 3)


def test_a_deadline_set_twice_to_the_same_time_expires_once():
    """touch() with a TTL that does not move the deadline pushes a second heap item for it."""
    now = [0.0]
    buf = CacheBuffer(4, create_policy("lru", 4), clock=lambda: now[0])
    block = bid(1)
    buf.reserve([block], ttl_ms=500)
    buf.commit([block], True)
    buf.touch([block], ttl_ms=500)
    now[0] = 0.6
    assert buf.sweep_expired() == [block]
    assert block not in buf.committed_ids()
