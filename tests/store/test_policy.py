"""ReplacementPolicy: the slot pool and the lru/clock/fifo disciplines."""

import pytest

from ninfer_jax.store import InvalidParam, ReplacementPolicy, create_policy, register_policy
from ninfer_jax.store.policies import known_policies
from ninfer_jax.store.policy import SlotState

POLICIES = ["lru", "clock", "fifo"]


def filled(name, capacity=3):
    policy = create_policy(name, capacity)
    for _ in range(capacity):
        policy.commit_slot(policy.acquire_slot().slot)
    return policy


def test_registry_knows_the_three_policies():
    assert {"lru", "clock", "fifo"} <= set(known_policies())


def test_unknown_policy_lists_known_names():
    with pytest.raises(InvalidParam, match=r"unknown replacement policy 'mru'; known: \["):
        create_policy("mru", 4)


def test_duplicate_registration_is_refused():
    with pytest.raises(InvalidParam, match="already registered"):
        register_policy("lru")(ReplacementPolicy)


@pytest.mark.parametrize("capacity", [0, -1, True])
def test_capacity_must_be_positive(capacity):
    with pytest.raises(InvalidParam, match="capacity"):
        create_policy("lru", capacity)


@pytest.mark.parametrize("name", POLICIES)
def test_free_list_hands_out_every_slot_once_then_evicts(name):
    policy = create_policy(name, 4)
    got = [policy.acquire_slot() for _ in range(4)]
    assert sorted(a.slot for a in got) == [0, 1, 2, 3] and not any(a.evicted for a in got)
    assert policy.num_free == 0
    assert policy.acquire_slot() is None  # all reserved, nothing committed
    for a in got:
        policy.commit_slot(a.slot)
    victim = policy.acquire_slot()
    assert victim.evicted and policy.state(victim.slot) is SlotState.RESERVED


@pytest.mark.parametrize("name", POLICIES)
def test_free_list_reuses_released_slots(name):
    policy = filled(name)
    policy.release_slot(1)
    policy.release_slot(0)
    assert policy.num_free == 2
    assert {policy.acquire_slot().slot, policy.acquire_slot().slot} == {0, 1}
    policy.abort_slot(0)
    assert policy.acquire_slot().slot == 0


@pytest.mark.parametrize("name", POLICIES)
def test_pinned_slots_are_never_victims(name):
    policy = filled(name)
    policy.pin_slot(0)
    policy.pin_slot(2)
    assert policy.acquire_slot().slot == 1
    assert policy.acquire_slot() is None
    policy.unpin_slot(0)
    assert policy.acquire_slot().slot == 0


def test_lru_evicts_least_recently_touched():
    policy = filled("lru")
    policy.touch_slot(0)
    assert policy.acquire_slot().slot == 1


def test_fifo_ignores_touches():
    policy = filled("fifo")
    policy.touch_slot(0)
    assert policy.acquire_slot().slot == 0


def test_clock_gives_touched_slots_a_second_chance():
    policy = filled("clock")
    policy.touch_slot(0)
    policy.touch_slot(1)
    assert policy.acquire_slot().slot == 2
    policy.commit_slot(2)
    assert policy.acquire_slot().slot == 0  # its reference bit was cleared by the last sweep


@pytest.mark.parametrize("name", POLICIES)
def test_lifecycle_misuse_is_caught(name):
    policy = create_policy(name, 2)
    with pytest.raises(AssertionError):
        policy.commit_slot(0)  # free, not reserved
    slot = policy.acquire_slot().slot
    policy.commit_slot(slot)
    policy.pin_slot(slot)
    with pytest.raises(AssertionError):
        policy.release_slot(slot)
    with pytest.raises(AssertionError):
        policy.unpin_slot(1 - slot)
