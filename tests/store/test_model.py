"""Model-based tests: CacheBuffer and the cache store against a dict reference (G2-G4, G7, G9).

The reference knows, per block, whether it is committed (with a deadline), its pins and its
outstanding allocs; capacity pressure is not modelled, so the checks are the safety properties:
anything visible was committed and not expired, nothing pinned or reserved disappears, reservations
are invisible, and the slot pool never over-commits.
"""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ninfer_jax.store import (
    BlockPayload,
    CacheBuffer,
    InvalidParam,
    JobDescriptor,
    NoSpace,
    NotFound,
    create_policy,
)
from ninfer_jax.store.types import RequestContext
from tests.store.helpers import BLOCK_BYTES, FakeClock, block_data, cache_store, ids

NUM_IDS = 6
batches = st.lists(st.integers(0, NUM_IDS - 1), min_size=1, max_size=3, unique=True)
ttls = st.one_of(st.none(), st.sampled_from([500, 2000]))


class BufferMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.clock = FakeClock()
        self.policy = create_policy("lru", 4)
        self.buf = CacheBuffer(4, self.policy, self.clock)
        self.committed: dict[int, float | None] = {}  # block -> deadline, may be evicted
        self.pins: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.success: dict[int, bool] = {}
        self.pending_ttl: dict[int, int | None] = {}

    def _live(self, i):
        d = self.committed.get(i)
        return i in self.committed and (d is None or d > self.clock.now)

    @rule(batch=batches, ttl=ttls, partial=st.booleans())
    def reserve(self, batch, ttl, partial):
        try:
            res = self.buf.reserve(ids(*batch), ttl, partial=partial)
        except NoSpace:
            assert not partial, "a partial reservation never fails for want of space"
            return
        unplaced = {int.from_bytes(b.bytes, "little") for b in res.unplaced}
        assert [slot is None for slot in res.slots] == [i in unplaced for i in batch]
        for block in res.evicted:
            victim = int.from_bytes(block.bytes, "little")
            assert not self.pins.get(victim) and not self.refs.get(victim), "guarded victim"
            del self.committed[victim]
        for i in batch:
            if i in self.committed and not self._live(i) and self.pins.get(i, 0) == 0 \
                    and self.refs.get(i, 0) == 0:
                del self.committed[i]
            if i in unplaced:
                assert i not in self.committed and not self.refs.get(i), "a known block unplaced"
                continue
            if self.refs.get(i, 0) == 0:
                self.success[i] = False
            self.refs[i] = self.refs.get(i, 0) + 1
            self.pending_ttl[i] = ttl

    @precondition(lambda self: any(self.refs.values()))
    @rule(data=st.data(), ok=st.booleans())
    def commit(self, data, ok):
        i = data.draw(st.sampled_from(sorted(k for k, v in self.refs.items() if v)))
        self.buf.commit(ids(i), ok)
        self.refs[i] -= 1
        self.success[i] |= ok
        if self.refs[i]:
            return
        ttl = self.pending_ttl[i]
        deadline = None if ttl is None else self.clock.now + ttl / 1000
        if i not in self.committed:
            if self.success[i]:
                self.committed[i] = deadline
        elif self.success[i] and not self._live(i):
            self.committed[i] = deadline

    @rule(batch=batches)
    def pin(self, batch):
        visible = self.buf.lookup(ids(*batch))
        try:
            self.buf.pin(ids(*batch))
        except NotFound:
            assert not all(visible)
            return
        assert all(visible)
        for i in batch:
            self.pins[i] = self.pins.get(i, 0) + 1

    @rule(batch=batches)
    def unpin(self, batch):
        self.buf.unpin(ids(*batch))
        for i in batch:
            self.pins[i] = max(0, self.pins.get(i, 0) - 1)

    @rule(batch=batches, ttl=ttls)
    def touch(self, batch, ttl):
        before = {i: self.buf.lookup(ids(i))[0] for i in batch}
        self.buf.touch(ids(*batch), ttl)
        for i in batch:
            d = self.committed.get(i)
            if before[i] and ttl is not None and d is not None:
                self.committed[i] = max(d, self.clock.now + ttl / 1000)

    @rule(seconds=st.sampled_from([0.1, 0.6, 3.0]))
    def tick(self, seconds):
        self.clock.advance(seconds)

    @rule()
    def sweep(self):
        self.buf.sweep_expired()

    @invariant()
    def visibility_matches_reference(self):
        visible = self.buf.committed_ids()
        for i in range(NUM_IDS):
            block = ids(i)[0]
            if block in visible:
                assert self._live(i), f"block {i} visible but not committed and live"
                assert self.buf.pin_count(block) == self.pins.get(i, 0)
            elif self._live(i):
                assert not self.pins.get(i) and not self.refs.get(i), \
                    f"guarded live block {i} disappeared"
            if self.refs.get(i, 0) and i not in self.committed:
                assert block not in visible, f"reservation of {i} is visible"

    @invariant()
    def pool_accounting(self):
        held = self.buf.pending_ids() | self.buf.committed_ids()
        assert len(held) + self.buf.num_free_slots() <= self.buf.capacity
        evictable = sum(self.policy.is_evictable(slot) for slot in range(self.buf.capacity))
        assert self.buf.num_placeable() == self.buf.num_free_slots() + evictable

    @invariant()
    def counters_match_reference(self):
        assert self.buf.num_pins() == sum(self.pins.values())
        assert self.buf.num_allocs() == sum(self.refs.values())


TestBufferModel = BufferMachine.TestCase
TestBufferModel.settings = settings(max_examples=120, stateful_step_count=30, deadline=None)


class CacheStoreMachine(RuleBasedStateMachine):
    """The cache store's data: a load returns exactly the bytes of the block's content (G1: one
    id, one content), visible blocks were all written by a successful dump (G2), and a final
    commit(False) before the dump's completion is consumed is refused (G4)."""

    def __init__(self):
        super().__init__()
        self.clock = FakeClock()
        self.store = cache_store(capacity=3, clock=self.clock)
        self.facet = self.store.as_token_addressed()
        self.job = 0
        self.written: set[int] = set()
        self.pinned: dict[int, int] = {}

    def teardown(self):
        self.store.close()

    def _next(self):
        self.job += 1
        return self.job

    @rule(batch=batches, ok=st.booleans(), ttl=ttls)
    def put(self, batch, ok, ttl):
        try:
            token = self.facet.alloc(ids(*batch), RequestContext("r", ttl))
        except NoSpace:
            return
        job = self._next()
        self.facet.dump(job, JobDescriptor(ids(*batch),
                                           [BlockPayload([block_data(i)]) for i in batch]),
                        token)
        if not ok:
            try:
                self.facet.commit(ids(*batch), False)
                raise AssertionError("commit before the dump was consumed must be refused")
            except InvalidParam:
                pass
        assert self.store.wait([job])[0].success
        self.facet.commit(ids(*batch), ok)
        if ok:
            self.written.update(batch)

    @rule(batch=batches)
    def get(self, batch):
        try:
            token = self.facet.pin(ids(*batch))
        except NotFound:
            return
        outs = [BlockPayload([np.zeros(BLOCK_BYTES, np.uint8)]) for _ in batch]
        job = self._next()
        self.facet.load(job, JobDescriptor(ids(*batch), outs), token)
        assert self.store.wait([job])[0].success
        self.facet.unpin(ids(*batch))
        for i, out in zip(batch, outs):
            assert i in self.written
            np.testing.assert_array_equal(out.buffers[0], block_data(i))

    @rule(seconds=st.sampled_from([0.3, 3.0]))
    def tick(self, seconds):
        self.clock.advance(seconds)

    @invariant()
    def visible_blocks_were_written(self):
        for block in self.store.buffer.committed_ids():
            assert int.from_bytes(block.bytes, "little") in self.written


TestCacheStoreModel = CacheStoreMachine.TestCase
TestCacheStoreModel.settings = settings(max_examples=60, stateful_step_count=20, deadline=None)
