"""The Python API under arbitrary argument values: every call either works or raises the API's own
named error (RejectedError with its field, SamplingParamsError, ScoreInputError), never a
TypeError or ZeroDivisionError from deep inside, and a refused call takes nothing."""

from __future__ import annotations

import math
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer_jax.api import Engine
from ninfer_jax.engine import EngineCore, EngineCoreConfig, RejectedError
from ninfer_jax.frontend import ChatTemplate, Frontend
from ninfer_jax.sampling_params import SamplingParams, SamplingParamsError
from ninfer_jax.testing.fake_program import FakeProgram
from tests.engine.conftest import EOS, TOKENIZER, limits

WEIRD = st.sampled_from([None, None, "", "x", "\ud800", 0, 1, -1, 2.5, math.nan, math.inf, True,
                         [], [5], ["a"], [None], {}, {"role": "user"}, b"ab", (1, 2), object()])
GOOD = {
    "prompt": st.just("hello"),
    "messages": st.just([{"role": "user", "content": "hi"}]),
    "prompt_token_ids": st.just([104, 105]),
}
ARGS = ("prompt", "messages", "prompt_token_ids", "sampling", "session", "enable_thinking",
        "deadline_s", "queue_timeout_s", "cache_salt", "allow_control_tokens")
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed", "max_new_tokens", "stop")


def _engine() -> Engine:
    program = FakeProgram(limits(2, max_seq_len=300, total_pages=160), eos_id=EOS)
    core = EngineCore(program, Frontend(TOKENIZER, ChatTemplate(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant\n")), EngineCoreConfig(max_queue=3, idle_wait_s=0.01))
    return Engine(core, core.frontend, None)


ENGINE = _engine()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_submit_works_or_names_the_field(data):
    kwargs = {}
    source = data.draw(st.sampled_from(sorted(GOOD)))
    kwargs[source] = data.draw(st.one_of(GOOD[source], WEIRD))
    for name in data.draw(st.lists(st.sampled_from(ARGS), max_size=4, unique=True)):
        kwargs[name] = data.draw(WEIRD)
    if "sampling" in kwargs and kwargs["sampling"] is None and data.draw(st.booleans()):
        kwargs["sampling"] = {data.draw(st.sampled_from(SAMPLING_FIELDS)): data.draw(WEIRD)}
    try:
        handle = ENGINE.submit(**kwargs)
    except RejectedError as e:
        assert e.field, f"{kwargs!r} refused without naming a field: {e}"
    else:
        result = handle.result(timeout=10)
        assert result.error is None, result.error
    _assert_idle()


def _assert_idle(timeout: float = 5.0) -> None:
    """Nothing outstanding, every lane and page free (stats are republished by the worker)."""
    deadline = time.monotonic() + timeout
    while True:
        s = ENGINE.stats()
        if s.outstanding == 0 and s.free_lanes == s.total_lanes and s.free_pages == s.total_pages:
            return
        assert time.monotonic() < deadline, s
        time.sleep(0.005)


def test_after_the_storm_everything_is_free():
    handle = ENGINE.submit("hello", sampling=SamplingParams(max_new_tokens=2))
    assert handle.result(timeout=10).error is None
    _assert_idle()


@settings(max_examples=300, deadline=None)
@given(fields=st.dictionaries(st.sampled_from(SAMPLING_FIELDS), WEIRD, max_size=4))
def test_sampling_params_work_or_name_the_field(fields):
    try:
        SamplingParams(**fields)
    except SamplingParamsError as e:
        assert any(name in str(e) for name in fields), str(e)
