"""Materializing as a revocable claim (DESIGN §3, §8): a reload from the context store reads on
the store's transfer threads while the Engine goes on decoding the active requests; the request
starts when the read ends; a cancel (or a deadline) in that window revokes the read, imports
nothing and leaves no store request, job, page or slot behind. The read is held by a gate in the
test's ContextTiers (the read's end is seen only when the test says so), so every moment is
deterministic."""

from __future__ import annotations

import threading

from ninfer_jax.engine import FinishReason
from tests.engine.tier_helpers import (
    RecordingTiers,
    assert_program_explained,
    assert_store_quiet,
    submit,
    tiered_engine,
    wait_writes,
    want_ids,
)

X = list(b"the system say")  # 14 tokens: 2 K/V blocks and a state block at page size 8
MORE = list(b"more!!")
OTHER = list(b"an unrelated prompt")


class GatedTiers(RecordingTiers):
    """ContextTiers whose reads count as ended only once `gate` is set (the store's own read
    may be done: the Engine sees the window a slow tier would give it)."""

    gate = threading.Event()
    started = 0

    def start_reload(self, found, started):
        type(self).started += 1
        return super().start_reload(found, started)

    def read_ended(self, reload):
        return self.gate.is_set() and super().read_ended(reload)


def _stored_then_cleared(t):
    """X's checkpoint written to the store, then dropped from the device."""
    assert list(submit(t.core, X, 1).result(timeout=10).token_ids) == want_ids(X, 1)
    wait_writes(t.core)
    t.core.clear_prefix_cache()


def _reading(t, ids, budget):
    """Submits a request and returns its handle once its reload has started (held at the
    gate)."""
    reads = GatedTiers.started
    handle = submit(t.core, ids, budget)
    while GatedTiers.started == reads:
        threading.Event().wait(0.001)
    return handle


def _engine(tmp_path):
    return tiered_engine(tmp_path, 2, page_size=8, tiers_cls=GatedTiers)


def test_active_requests_decode_while_a_reload_reads(tmp_path):
    GatedTiers.gate.set()
    with _engine(tmp_path) as t:
        _stored_then_cleared(t)
        GatedTiers.gate.clear()
        busy = submit(t.core, OTHER, 40)
        next(iter(busy))  # decoding
        turn = _reading(t, X + MORE, 4)
        # the read is held: the other request still runs to its end meanwhile
        assert list(busy.result(timeout=30).token_ids) == want_ids(OTHER, 40)
        assert not turn.done
        GatedTiers.gate.set()
        result = turn.result(timeout=30)
        assert list(result.token_ids) == want_ids(X + MORE, 4)
        assert result.usage.cached_tokens == len(X)
        s = wait_writes(t.core).tiers
        assert s.reloads == 1 and s.reload_failures == 0
        assert_program_explained(t)
        assert_store_quiet(t)


def test_a_cancel_while_reading_revokes_the_read(tmp_path):
    GatedTiers.gate.set()
    with _engine(tmp_path) as t:
        _stored_then_cleared(t)
        GatedTiers.gate.clear()
        turn = _reading(t, X + MORE, 4)
        turn.cancel()
        result = turn.result(timeout=30)
        assert result.finish_reason is FinishReason.CANCELLED and not result.token_ids
        assert t.program.stats().num_sequences == 0  # it never held a sequence
        GatedTiers.gate.set()  # the read ends after its request: nothing is imported
        s = wait_writes(t.core)
        assert s.tiers.reloads == 0 and s.prefix.checkpoints == 0
        assert_program_explained(t)
        assert_store_quiet(t)
        # the store still serves the next request
        again = submit(t.core, X + MORE, 4).result(timeout=30)
        assert again.usage.cached_tokens == len(X)
