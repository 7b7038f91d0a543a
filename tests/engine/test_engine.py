"""Engine behaviour beyond the state machine: rejections before any mutation, failure handling,
stop strings, the asyncio handle, and the jax-free import rule. Cancellation, deadlines and queue
timeouts are in test_cancellation.py, capacity in test_capacity.py."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from ninfer_jax.engine import (
    Delta,
    EngineCore,
    EngineCoreConfig,
    Finished,
    FinishReason,
    GenerationStart,
    RejectedError,
)
from ninfer_jax.sampling_params import SamplingParams, SamplingParamsError
from ninfer_jax.testing.fake_program import FakeProgram
from tests.conftest import REPO
from tests.engine.conftest import (
    EOS,
    FRONTEND,
    GREEDY,
    TOKENIZER,
    fake_engine,
    limits,
    long_prompt,
    prompt,
    want,
)


def test_events_arrive_in_order_and_match_the_model():
    with fake_engine(2) as (core, _):
        h = core.submit(prompt("abc def"), GREEDY)
        events = list(h)
    assert isinstance(events[0], GenerationStart) and events[0].prompt_tokens == 7
    assert isinstance(events[-1], Finished)
    assert all(isinstance(e, Delta) for e in events[1:-1])
    ids = [t for e in events[1:-1] for t in e.token_ids]
    assert ids == want("abc def", 16)
    assert events[-1].usage.completion_tokens == len(ids)


def test_concurrency_and_arrival_order_do_not_change_outputs():
    texts = [f"prompt {c} {'x' * i}" for i, c in enumerate("abcdefghij")]
    samplings = [SamplingParams(temperature=0.9 if i % 2 else 0.0, seed=i, max_new_tokens=12)
                 for i in range(len(texts))]
    for concurrency, order in ((1, range(10)), (3, reversed(range(10))), (8, range(10))):
        with fake_engine(concurrency) as (core, _):
            handles = {i: core.submit(prompt(texts[i]), samplings[i]) for i in order}
            for i, h in handles.items():
                assert list(h.result(timeout=10).token_ids) == want(texts[i], 12, seed=i)


def test_rejections_happen_before_any_program_mutation():
    with fake_engine(1, max_queue=2, max_seq_len=32) as (core, program):
        before = program.stats()
        with pytest.raises(RejectedError, match="prompt has 40 tokens; the context limit "
                                                "max_seq_len is 32"):
            core.submit(prompt("x" * 40), GREEDY)
        with pytest.raises(RejectedError, match=r"max_new_tokens: prompt_len 3 \+ max_new_tokens "
                                                r"100 = 103 exceeds max_seq_len 32"):
            core.submit(prompt("abc"), SamplingParams(max_new_tokens=100))
        with pytest.raises(SamplingParamsError, match="top_p must be a finite number in"):
            SamplingParams(top_p=1.5)
        with pytest.raises(RejectedError, match="sampling must be a SamplingParams"):
            core.submit(prompt("abc"), {"temperature": 1.0})
        assert program.stats() == before and program.num_steps == 0
        slow = [core.submit(prompt("abc"), SamplingParams(temperature=0, max_new_tokens=20))
                for _ in range(2)]
        with pytest.raises(RejectedError, match="queue full: 2 outstanding requests, "
                                                "max_queue is 2") as e:
            core.submit(prompt("abc"), GREEDY)
        assert e.value.reason == "overload"
        for h in slow:
            h.result(timeout=10)
        core.submit(prompt("abc"), GREEDY).result(timeout=10)  # capacity came back


def test_injected_commit_failure_fails_the_engine_cleanly():
    with fake_engine(3, program_kw={"fail_commit_at": 4}) as (core, program):
        handles = [core.submit(prompt(f"request {i}"), GREEDY) for i in range(6)]
        results = [h.result(timeout=10) for h in handles]
        assert all(r.finish_reason is FinishReason.ERROR for r in results)
        assert all("engine_failed: InjectedFailure" in r.error for r in results)
        # Nothing from the failed batch was published: every output is a strict prefix.
        for i, r in enumerate(results):
            assert list(r.token_ids) == want(f"request {i}", 16)[: len(r.token_ids)]
        assert not core.available
        with pytest.raises(RejectedError, match="not available: InjectedFailure") as e:
            core.submit(prompt("later"), GREEDY)
        assert e.value.reason == "unavailable"
        stats = program.stats()
        assert stats.free_pages == stats.total_pages and stats.num_sequences == 0
        assert program.pending is None


def test_stop_string_across_tokens_is_not_emitted():
    text = TOKENIZER.decode(want("stop here", 24))
    stop = text[5:8]
    with fake_engine(2) as (core, _):
        r = core.submit(prompt("stop here"),
                        SamplingParams(temperature=0, max_new_tokens=24, stop=(stop,))).result()
    assert r.finish_reason is FinishReason.STOP
    assert r.text == text[: text.index(stop)] and stop not in r.text


def test_async_handle():
    async def main(core):
        h = core.submit(prompt("async"), GREEDY, loop=asyncio.get_running_loop())
        events = [e async for e in h]
        return events, await h.aresult()

    with fake_engine(2) as (core, _):
        events, result = asyncio.run(main(core))
    assert isinstance(events[-1], Finished)
    assert list(result.token_ids) == want("async", 16)


def test_engine_package_imports_no_jax():
    code = ("import sys, ninfer_jax.engine, ninfer_jax.testing.fake_program, "
            "ninfer_jax.testing.tokenizer, ninfer_jax.program.host; "
            "bad = [m for m in sys.modules if m == 'jax' or m.startswith('jax.')]; "
            "assert not bad, bad; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         check=False)
    assert out.stdout.strip() == "ok", out.stderr


def test_background_compiles_are_held_while_requests_are_outstanding():
    """The Engine holds the Program's background compiles from a request's arrival until it
    has nothing left to do (they would take the cores from the steps it serves)."""
    calls = []

    class Recording(FakeProgram):
        def hold_compiles(self, held: bool) -> None:
            calls.append(held)

    program = Recording(limits(2), eos_id=EOS)
    core = EngineCore(program, FRONTEND, EngineCoreConfig(idle_wait_s=0.01))
    try:
        text = long_prompt(6)
        r = core.submit(prompt(text), SamplingParams(temperature=0, max_new_tokens=6)).result(
            timeout=10)
        assert list(r.token_ids) == want(text, 6)
        deadline = time.monotonic() + 10
        while calls[-1:] != [False] and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        core.close()
    assert calls == [True, False]
