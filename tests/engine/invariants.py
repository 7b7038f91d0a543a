"""Invariants every quiet Engine must satisfy, shared by the storms and state machines."""

from __future__ import annotations


def assert_transactions_settled(stats, num_checkpoints: int) -> None:
    """Every resource transaction ended exactly once (none is running), every sequence made
    was released, and the checkpoints the Program holds are those captured or placed and not
    deleted. Only a materialization aborts (a cancel or deadline while it waits); the other
    transitions are single steps that commit. `stats`: EngineStats of a quiet Engine."""
    tx = stats.transactions
    assert tx.running == 0 and tx.started == tx.committed + tx.aborted, tx
    by = tx.by_transition
    assert by["materialize"][0] == by["release"][0], by
    assert by["capture"][0] + by["place"][0] - by["delete"][0] == num_checkpoints, \
        (by, num_checkpoints)
    assert all(by[t][1] == 0 for t in ("capture", "place", "release", "delete")), by
