"""Event-driven admission (DESIGN §4): a blocked FIFO head is rechecked only when a fact that
decides its admission changes (capacity released, a checkpoint published or evicted, the waiting
requests, a lane), never on every decode round; and it is admitted as soon as one does."""

from __future__ import annotations

import threading

from ninfer_jax.sampling_params import SamplingParams
from tests.engine.conftest import fake_engine, long_prompt, prompt, settle


class _Counting:
    """Counts the Program's admission plans (each admission attempt makes at least one)."""

    def __init__(self, program):
        self.calls = 0
        real = program.plan_admission

        def plan(*args, **kw):
            self.calls += 1
            return real(*args, **kw)

        program.plan_admission = plan


def test_a_blocked_head_is_not_replanned_every_round():
    # 24 pages of 4 tokens: the incumbent reserves 19, the head needs 19 too.
    with fake_engine(2, total_pages=24, max_seq_len=80) as (core, program):
        plans = _Counting(program)
        decodes = []
        program.on("after_decode", lambda seqs: decodes.append(plans.calls))
        incumbent = core.submit(prompt(long_prompt(70, "inc")),
                                SamplingParams(max_new_tokens=70, temperature=0))
        head = core.submit(prompt("head"), SamplingParams(max_new_tokens=70, temperature=0))
        assert incumbent.result(timeout=30).usage.completion_tokens == 70
        assert head.result(timeout=30).usage.completion_tokens >= 1
        # 69 decode rounds of the incumbent alone, with the head waiting: the plans made
        # during them are the head's first attempt (and none per round); its admission once
        # the incumbent's end released the capacity is one more.
        alone = decodes[:69]
        assert alone[-1] - alone[0] <= 1, alone
        assert plans.calls <= alone[-1] + 2
        assert settle(core).free_pages == 24


def test_a_head_blocked_on_capacity_does_not_count_as_filling_the_batch():
    """`Admission.filling` (while true the draft policy runs the cheapest round, so a waiting
    request is admitted sooner) is false while the head waits on capacity, though a lane is
    free: the incumbent's rounds are not held back for a request that cannot enter."""
    with fake_engine(2, total_pages=24, max_seq_len=80) as (core, program):
        seen = []
        program.on("after_decode", lambda seqs: seen.append(
            (bool(core.scheduler.waiting), core.admission.filling())))
        incumbent = core.submit(prompt(long_prompt(70, "inc")),
                                SamplingParams(max_new_tokens=70, temperature=0))
        head = core.submit(prompt("head"), SamplingParams(max_new_tokens=70, temperature=0))
        assert incumbent.result(timeout=30).usage.completion_tokens == 70
        assert head.result(timeout=30).usage.completion_tokens >= 1
        waiting = [filling for was_waiting, filling in seen[:69] if was_waiting]
        assert len(waiting) >= 60 and not any(waiting), seen[:69]


def test_a_new_waiting_request_is_considered_for_backfill():
    """A later request that fits beside the incumbents (and cannot delay the head) is a fact
    that changes the outcome: it is admitted without waiting for any capacity release."""
    # each step takes 2 ms: the incumbent runs >= 120 ms, far beyond the two iterations the
    # backfill takes
    with fake_engine(3, total_pages=36, max_seq_len=80,
                     program_kw={"step_seconds": 0.002}) as (core, program):
        started = threading.Event()
        program.on("after_decode", lambda seqs: started.set())
        incumbent = core.submit(prompt(long_prompt(60, "inc")),
                                SamplingParams(max_new_tokens=60, temperature=0))
        assert started.wait(30)
        head = core.submit(prompt("head"), SamplingParams(max_new_tokens=75, temperature=0))
        small = core.submit(prompt("s"), SamplingParams(max_new_tokens=2, temperature=0))
        assert small.result(timeout=30).usage.completion_tokens >= 1
        assert not incumbent.done  # admitted while the incumbent still ran
        assert core.stats().backfilled == 1
        incumbent.result(timeout=30)
        head.result(timeout=30)
        settle(core)


def test_the_turn_checkpoint_exists_before_the_last_delta_goes_out():
    """Terminal order (DESIGN §6): a finishing row's resource result (its turn checkpoint
    retained, its sequence released) is adopted before its last delta is published."""
    from ninfer_jax.engine import Delta, Finished

    with fake_engine(2, total_checkpoint_slots=8) as (core, program):
        log = []
        publication = core.publication
        capture, release, emit = program.capture, program.release, publication._emit

        def logged_capture(handle, **kw):
            log.append(("capture", program.num_generated(handle)))
            return capture(handle, **kw)

        def logged_release(handle):
            log.append(("release",))
            release(handle)

        def logged_emit(r, event):
            if isinstance(event, (Delta, Finished)):
                log.append((type(event).__name__,))
            emit(r, event)

        program.capture, program.release = logged_capture, logged_release
        publication._emit = logged_emit
        for max_new in (1, 6):  # finishing in the prefill's unit and in a decode round
            log.clear()
            text = long_prompt(max_new, f"t{max_new}")
            result = core.submit(prompt(text), SamplingParams(
                max_new_tokens=max_new, temperature=0)).result(timeout=30)
            assert result.usage.completion_tokens == max_new
            kinds = [e[0] for e in log]
            last_delta = len(kinds) - 1 - kinds[::-1].index("Delta")
            assert kinds[-1] == "Finished"
            assert "release" in kinds[:last_delta], log  # released before the last delta
            if max_new > 1:  # the turn frontier (beyond the prompt's) was captured first
                turn = [e for e in log if e[0] == "capture" and e[1] == max_new]
                assert turn and log.index(turn[0]) < last_delta, log
        settle(core)


def test_a_finishing_request_keeps_its_turn_in_the_slot_reserved_at_activation():
    """The publication slot (DESIGN §7): reserved when the request activates (while at most
    half the checkpoint slots are reserved), taken by its turn checkpoint at the end, so the
    end evicts nothing even when every other slot is full; freed with the sequence if unused."""
    from ninfer_jax.engine import Finished

    with fake_engine(2, total_checkpoint_slots=4) as (core, program):
        greedy1 = SamplingParams(max_new_tokens=1, temperature=0)
        for i in range(3):  # three inactive checkpoints
            core.submit(prompt(f"filler {i}"), greedy1).result(timeout=30)
        assert settle(core).prefix.checkpoints == 3
        log = []
        capture, release_ckpt = program.capture, program.release_checkpoint
        emit = core.publication._emit

        def logged_capture(handle, **kw):
            log.append(("capture", kw.get("publication", False)))
            return capture(handle, **kw)

        def logged_release(ckpt):
            log.append(("evict",))
            release_ckpt(ckpt)

        def logged_emit(r, event):
            if isinstance(event, Finished):
                log.append(("Finished",))
            emit(r, event)

        program.capture, program.release_checkpoint = logged_capture, logged_release
        core.publication._emit = logged_emit
        program.on("after_commit", lambda seqs: log.append(("commit",)))
        text = long_prompt(5, "turn")
        result = core.submit(prompt(text), SamplingParams(max_new_tokens=5, temperature=0)
                             ).result(timeout=30)
        assert result.usage.completion_tokens == 5
        end = log.index(("Finished",))
        last_commit = max(i for i, e in enumerate(log[:end]) if e == ("commit",))
        assert ("capture", True) in log[last_commit:end], log  # the reserved slot
        assert ("evict",) not in log[last_commit:end], log  # nothing evicted at the end
        s = settle(core)
        assert s.prefix.checkpoints == 4  # two fillers, the prompt's and the turn's
        assert program.stats().free_checkpoint_slots == 0
