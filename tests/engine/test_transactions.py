"""Resource transactions (DESIGN §4): each ends once with a complete result, the
ResourceManager adopts results into lanes and the catalog, and an Engine's transactions
settle: a cancel while Materializing (a read in flight, or committed but not adopted)
aborts or releases, never leaks."""

from __future__ import annotations

import pytest

from ninfer_jax.engine.events import InvariantError
from ninfer_jax.engine.resources import LaneState, ResourceManager
from ninfer_jax.engine.transactions import Transition
from ninfer_jax.program.checkpoints import CheckpointId


def test_a_transaction_ends_once_and_its_result_is_adopted_once():
    rm = ResourceManager(2)
    txn = rm.begin(Transition.CAPTURE, 7)
    result = txn.commit(checkpoint=CheckpointId(3), tokens=(1, 2, 3), scope="t")
    with pytest.raises(InvariantError, match="ended twice"):
        txn.abort("late")
    entry = rm.adopt(result)
    assert entry.ckpt == CheckpointId(3) and rm.catalog.get((1, 2, 3), "t") is entry
    with pytest.raises(InvariantError, match="adopted twice"):
        rm.adopt(result)
    delete = rm.begin(Transition.DELETE)
    rm.adopt(delete.commit(checkpoint=CheckpointId(3), tokens=(1, 2, 3), scope="t",
                           evicted=True))
    assert len(rm.catalog) == 0
    s = rm.transactions.stats()
    assert (s.started, s.committed, s.aborted, s.running) == (2, 2, 0, 0)


def test_a_materialization_commits_to_an_active_lane_or_aborts_to_a_free_one():
    rm = ResourceManager(2)
    for lane, commit in ((0, True), (1, False)):
        rm.move(lane, LaneState.MATERIALIZING, lane)
        txn = rm.begin(Transition.MATERIALIZE, lane)
        txn.reload = object()  # a read in flight: it must be revoked before an abort
        if not commit:
            with pytest.raises(InvariantError, match="in flight"):
                txn.abort("cancelled")
        txn.reload = None
        result = txn.commit(sequence="seq", cached_tokens=16) if commit \
            else txn.abort("cancelled")
        rm.adopt(result, lane)
        assert result.committed is commit
    assert rm.lanes == [LaneState.ACTIVE, LaneState.FREE]
    assert rm.transactions.stats().by_transition["materialize"] == (1, 1)


def test_engine_cleanup_ends_running_transactions():
    rm = ResourceManager(1)
    rm.move(0, LaneState.MATERIALIZING, 0)
    rm.begin(Transition.MATERIALIZE, 0).reload = object()
    rm.clear()
    s = rm.transactions.stats()
    assert (s.running, s.aborted) == (0, 1) and rm.lanes == [LaneState.FREE]
