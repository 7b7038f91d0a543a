"""The failure table (DESIGN §8), driven deterministically through the FakeProgram: each fault
that leaves shared state unexplainable fails the whole Engine, in the cleanup order (the
Program's pending work ended, active state released, the ResourceManager cleared, every
response finished with an error), and later submits are refused. (The injected commit failure
and the reject-only rows are in test_engine.py.)"""

from __future__ import annotations

import dataclasses
import threading

import pytest

from ninfer_jax.engine import FinishReason, RejectedError
from ninfer_jax.sampling_params import SamplingParams
from tests.engine.conftest import fake_engine, long_prompt, prompt

LONG = SamplingParams(max_new_tokens=40, temperature=0)
SLOW = {"step_seconds": 0.002}  # 40 rounds >= 80 ms: the fault lands while both still run


def _assert_failed_cleanly(core, program, handles, cause: str):
    results = [h.result(timeout=30) for h in handles]
    assert all(r.finish_reason is FinishReason.ERROR for r in results), results
    assert all(r.error.startswith("engine_failed:") and cause in r.error for r in results)
    assert not core.available
    with pytest.raises(RejectedError) as e:
        core.submit(prompt("later"), LONG)
    assert e.value.reason == "unavailable"
    s = program.stats()
    assert s.num_sequences == 0 and s.num_checkpoints == 0 and program.pending is None
    assert s.free_pages == s.total_pages and s.free_slots == s.total_slots
    assert core.resources.num_free() == len(core.resources.lanes)


def _start_two(core, program):
    """Two requests decoding together (a hook waits for a round of B = 2)."""
    both = threading.Event()
    program.on("after_decode", lambda seqs: len(seqs) == 2 and both.set())
    handles = [core.submit(prompt(long_prompt(40, f"r{i}")), LONG) for i in range(2)]
    assert both.wait(30)
    return handles


def test_a_pending_batch_whose_rows_are_not_the_rounds_fails_the_engine():
    with fake_engine(2, total_checkpoint_slots=4, program_kw=SLOW) as (core, program):
        handles = _start_two(core, program)
        decode = type(program).decode

        def swapped(handles, *args, **kw):  # the Program answers for the rows in another order
            return decode(program, list(reversed(handles)), *args, **kw)

        program.decode = swapped
        _assert_failed_cleanly(core, program, handles, "membership")


def test_a_sequence_released_behind_the_engine_fails_it():
    """Handle owner/generation mismatch: the Engine's handle no longer names a sequence."""
    with fake_engine(2, total_checkpoint_slots=4, program_kw=SLOW) as (core, program):
        handles = _start_two(core, program)
        decode = type(program).decode
        done = []

        def stale(handles, *args, **kw):  # on the worker thread, before the next round
            if not done:
                done.append(handles[0])
                program.release(handles[0])  # as if another owner had taken it back
            return decode(program, handles, *args, **kw)

        program.decode = stale
        _assert_failed_cleanly(core, program, handles, "stale sequence handle")


def test_a_broken_adoption_invariant_fails_the_engine():
    """A Frontend preview that accepts none of a round's tokens breaks the adoption rule
    (a non-cancelled row accepts 1..produced)."""
    with fake_engine(2, total_checkpoint_slots=4, program_kw=SLOW) as (core, program):
        handles = _start_two(core, program)
        record = next(r for r in core._active if r.seq is not None)
        real = record.session.preview

        def nothing(tokens, **kw):
            return dataclasses.replace(real(tokens, **kw), token_ids=())

        record.session.preview = nothing
        _assert_failed_cleanly(core, program, handles, "accepted no sampled token")
