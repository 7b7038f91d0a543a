"""The notebook path of the public API: `engine.stream` / `engine.astream`, what an interrupted
cell leaves behind (a KeyboardInterrupt, real or raised inside the wait, leaves nothing active
and full capacity before it reaches the caller), rich display and progress bars."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
import types

import numpy as np
import pytest

from ninfer_jax import display, progress
from ninfer_jax.engine import Delta, FinishReason, GenerationResult, TokenLogprob, Usage
from ninfer_jax.sampling_params import SamplingParams
from tests.gateway.conftest import make_engine

LONG = SamplingParams(temperature=0.0, max_new_tokens=400)


@pytest.fixture
def engine():
    e = make_engine(2, eos=False, step_seconds=0.01)
    yield e
    e.close()


def _assert_idle(engine, timeout: float = 5.0) -> None:
    """Nothing active or waiting, every lane free, no outstanding capacity. The worker
    republishes its stats after a consumer releases capacity, within an iteration."""
    assert engine.core._outstanding == 0  # the live counter: back before the caller resumes
    deadline = time.monotonic() + timeout
    while True:
        s = engine.stats()
        if (s.active, s.waiting, s.outstanding, s.free_lanes) == (0, 0, 0, s.total_lanes):
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.01)


def _interrupt_main_in(seconds: float) -> threading.Timer:
    """A real SIGINT delivered to the main thread (what Jupyter's interrupt sends), with
    Python's own handler installed and SIGINT unblocked there, whatever earlier tests in this
    process left (in one full run both interrupt tests saw no KeyboardInterrupt; alone they
    pass)."""
    assert threading.current_thread() is threading.main_thread()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    main = threading.main_thread().ident
    timer = threading.Timer(seconds, signal.pthread_kill, (main, signal.SIGINT))
    timer.start()
    return timer


def test_stream_yields_the_answer_delta_by_delta(engine):
    stream = engine.stream("hello", sampling=SamplingParams(temperature=0.0, max_new_tokens=12))
    deltas = list(stream)
    assert all(isinstance(d, Delta) for d in deltas) and len(deltas) >= 2
    assert stream.result.finish_reason is FinishReason.LENGTH
    assert "".join(d.text for d in deltas) == stream.result.text
    assert list(stream) == []  # exhausted
    _assert_idle(engine)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals reach the main thread only")
def test_a_real_interrupt_while_streaming_cancels_and_frees_everything(engine):
    seen = []
    timer = _interrupt_main_in(0.3)
    try:
        with pytest.raises(KeyboardInterrupt):
            with engine.stream("hello", sampling=LONG) as stream:
                for delta in stream:
                    seen.append(delta)
    finally:
        timer.cancel()
    assert seen and stream.result.finish_reason is FinishReason.CANCELLED
    assert stream.result.usage.completion_tokens < LONG.max_new_tokens
    _assert_idle(engine)
    again = engine.generate("hello", sampling=SamplingParams(max_new_tokens=4))
    assert again.finish_reason is FinishReason.LENGTH


def test_an_interrupt_inside_the_wait_of_a_plain_for_loop_frees_everything(engine, monkeypatch):
    """No `with`: the interrupt lands where a notebook's lands, in the blocking wait of next()."""
    stream = engine.stream("hello", sampling=LONG)
    sink, calls = stream.handle._sink, []
    real_get = sink.get

    def get(timeout):
        calls.append(timeout)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_get(timeout)

    monkeypatch.setattr(sink, "get", get)
    with pytest.raises(KeyboardInterrupt):
        for _ in stream:
            pass
    monkeypatch.setattr(sink, "get", real_get)
    assert stream.result.finish_reason is FinishReason.CANCELLED
    _assert_idle(engine)


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signals reach the main thread only")
def test_an_interrupted_generate_cancels_and_frees_everything(engine):
    timer = _interrupt_main_in(0.3)
    try:
        with pytest.raises(KeyboardInterrupt):
            engine.generate("hello", sampling=LONG)
    finally:
        timer.cancel()
    _assert_idle(engine)
    assert engine.stats().finished_requests == 1


def test_astream_in_a_running_loop_and_leaving_early(engine):
    async def main():
        texts = []
        async with engine.astream("hello", sampling=LONG) as stream:
            async for delta in stream:
                texts.append(delta.text)
                if len(texts) == 3:
                    break
        return stream

    stream = asyncio.run(main())
    assert stream.result.finish_reason is FinishReason.CANCELLED
    _assert_idle(engine)

    async def whole():
        stream = engine.astream("hello", sampling=SamplingParams(temperature=0.0,
                                                                  max_new_tokens=6))
        return [d.text async for d in stream], stream

    texts, stream = asyncio.run(whole())
    assert "".join(texts) == stream.result.text and stream.result.usage.completion_tokens == 6


def test_a_cancelled_task_consuming_astream_frees_everything(engine):
    """An interrupted async cell cancels the task that iterates the stream."""
    async def consume():
        async for _ in engine.astream("hello", sampling=LONG):
            pass

    async def main():
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _assert_idle(engine)


def test_astream_needs_a_running_loop(engine):
    with pytest.raises(RuntimeError, match=r"running event loop.*use stream\(\)"):
        engine.astream("hello")
    _assert_idle(engine)


# Rich display -------------------------------------------------------------------------------
def _result(**kw) -> GenerationResult:
    base = dict(request_id=7, text="<b>hi</b> & bye", reasoning_text="", token_ids=(1, 2),
                finish_reason=FinishReason.STOP, usage=Usage(5, 2, 3), seed=11)
    return GenerationResult(**{**base, **kw})


def test_a_generation_result_shows_as_an_escaped_table_and_one_line():
    r = _result()
    html = r._repr_html_()
    assert "&lt;b&gt;hi&lt;/b&gt; &amp; bye" in html and "<b>hi</b>" not in html
    assert "prompt 5 (cached 3), completion 2" in html and "stop" in html
    assert display.generation_line(r) == (
        "GenerationResult(#7 stop, 2 tokens, cached 3/5: '<b>hi</b> & bye')")
    lps = (TokenLogprob(1, -0.01), TokenLogprob(2, -5.0))
    coloured = _result(logprobs=lps, decode=lambda ids: {1: "<a", 2: "b"}[ids[0]])._repr_html_()
    assert "hsl(119," in coloured and "hsl(1," in coloured and "&lt;a" in coloured
    assert "[1]" in _result(logprobs=lps)._repr_html_()  # no tokenizer: the ids


def test_stats_show_as_a_table_and_one_line(engine):
    engine.generate("hello", sampling=SamplingParams(max_new_tokens=3))
    _assert_idle(engine)
    s = engine.stats()
    assert "2 free of 2" in s._repr_html_() and "prefix cache" in s._repr_html_()
    assert display.stats_line(s).startswith("EngineStats(available: 0 active, 0 waiting, 2/2")


def test_a_score_result_shows_a_heat_map_of_its_tokens():
    from ninfer_jax.scoring import ScoreResult

    r = ScoreResult(token_ids=np.array([3, 4, 5], np.int32),
                    token_logprobs=np.array([0.0, -0.7, -20.0], np.float32),
                    greedy_flags=np.array([True, False, False]),
                    decode=lambda ids: {3: "a", 4: "\n", 5: "c"}[ids[0]])
    html = r._repr_html_()
    assert html.count("<span") == 3 and "hsl(120," in html and "hsl(0," in html
    assert "\u21b5<br>" in html and "sum log-prob" in html
    assert r.token_texts == ["a", "\n", "c"]
    assert display.score_line(r).startswith("ScoreResult(3 tokens, sum log-prob -20.7000")
    long = ScoreResult(np.arange(display.MAX_TOKENS_SHOWN + 5, dtype=np.int32),
                       np.zeros(display.MAX_TOKENS_SHOWN + 5, np.float32),
                       np.ones(display.MAX_TOKENS_SHOWN + 5, bool))
    assert "5 more tokens" in long._repr_html_()


# Progress -----------------------------------------------------------------------------------
def test_progress_shows_only_in_a_notebook_unless_asked(capsys, monkeypatch):
    assert progress.enabled(None) is False and progress.enabled(True) is True
    with pytest.raises(TypeError, match="progress must be True, False or None"):
        progress.enabled("yes")
    with progress.bar(None, 3, "quiet") as b:
        b.update(3)
    with progress.bar(True, 3, "loud") as b:
        b.update(3)
    err = capsys.readouterr().err
    assert "loud" in err and "quiet" not in err
    # In a notebook without ipywidgets, tqdm's widget bar cannot start: a text bar instead.
    monkeypatch.setattr(progress, "in_notebook", lambda: True)

    def no_widgets(*args, **kwargs):
        raise ImportError("IProgress not found")

    monkeypatch.setitem(sys.modules, "tqdm.auto", types.SimpleNamespace(tqdm=no_widgets))
    with progress.bar(None, 2, "quick") as b:  # in a notebook, a bar waits a second to show
        b.update(2)
    with progress.bar(True, 2, "fallback") as b:
        b.update(2)
    err = capsys.readouterr().err
    assert "fallback" in err and "quick" not in err


def test_scoring_reports_progress_when_asked(capsys):
    from ninfer_jax.scoring import ScoreRequest
    from tests.models.conftest import reference
    from tests.scoring.conftest import core

    c = core("dense")
    ids = reference("dense")["token_ids"]
    c.score([ScoreRequest(np.asarray(row, np.int32), 1) for row in ids.tolist()], progress=True)
    err = capsys.readouterr().err
    assert "scoring" in err and "3/3" in err


def test_convert_reports_the_tensors_it_reads_when_asked(capsys, tmp_path):
    from ninfer_jax.artifact.convert import convert
    from tests.conftest import FIXTURES

    convert(FIXTURES / "dense", tmp_path / "artifact", progress=True)
    err = capsys.readouterr().err
    assert "reading tensors: 100%" in err
    convert(FIXTURES / "dense", tmp_path / "quiet")  # default: only in a notebook
    assert capsys.readouterr().err == ""


def test_wait_compiled_on_an_engine_whose_program_compiles_nothing(engine):
    engine.wait_compiled(progress=True)
    assert engine.generate("hi", sampling=SamplingParams(max_new_tokens=2)).usage.completion_tokens
