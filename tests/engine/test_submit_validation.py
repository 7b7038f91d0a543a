"""Every public entry validates before it takes a resource: a refused submit leaves the Engine's
capacity, queue and Program exactly as they were, however many times it is refused, and each
refusal names the field. Prefix reuse is isolated per cache scope (tenant)."""

from __future__ import annotations

import math

import pytest

from ninfer_jax.engine import RejectedError
from ninfer_jax.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    StructuredOutput,
)
from tests.engine.conftest import FRONTEND, fake_engine, prompt, prompt_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=4)

BAD_SUBMITS = [
    ("deadline_s", {"deadline_s": "x"}),
    ("deadline_s", {"deadline_s": math.nan}),
    ("deadline_s", {"deadline_s": math.inf}),
    ("deadline_s", {"deadline_s": -1.0}),
    ("deadline_s", {"deadline_s": 0}),
    ("deadline_s", {"deadline_s": True}),
    ("queue_timeout_s", {"queue_timeout_s": "soon"}),
    ("queue_timeout_s", {"queue_timeout_s": math.nan}),
    ("session", {"session_key": 5}),
    ("cache_scope", {"cache_scope": b"tenant"}),
]


@pytest.mark.parametrize("field,kwargs", BAD_SUBMITS)
def test_bad_submit_arguments_never_take_capacity(field, kwargs):
    with fake_engine(max_queue=4) as (core, program):
        for _ in range(3 * core.config.max_queue):  # more than the capacity
            with pytest.raises(RejectedError) as e:
                core.submit(prompt("abc"), GREEDY, **kwargs)
            assert e.value.field == field and e.value.reason == "invalid"
        assert core.stats().outstanding == 0
        assert core.submit(prompt("abc"), GREEDY).result(timeout=10).error is None
        assert program.handles() == []


@pytest.mark.parametrize("bad", [None, "abc", [1, 2, 3]])
def test_a_prompt_must_be_prepared(bad):
    with fake_engine(max_queue=2) as (core, _):
        for _ in range(5):
            with pytest.raises(RejectedError, match="PreparedPrompt") as e:
                core.submit(bad, GREEDY)
            assert e.value.field == "prompt"
        assert core.stats().outstanding == 0


def test_sampling_and_config_types_are_named():
    with pytest.raises(SamplingParamsError, match="stop must be a string or a list"):
        SamplingParams(stop=5)
    from ninfer_jax.engine import EngineCoreConfig
    from ninfer_jax.errors import ConfigError
    from ninfer_jax.program.config import ProgramConfig

    for field, value in [("page_size", 0), ("page_size", "16"), ("max_seq_len", None),
                         ("num_pages", 2.5), ("max_concurrency", True)]:
        with pytest.raises(ConfigError, match=f"^{field} must be"):
            ProgramConfig(**{field: value})
    for field, value in [("max_queue", 0), ("queue_timeout_s", math.nan),
                         ("prefix_reuse", "yes")]:
        with pytest.raises(ConfigError, match=f"^{field} must be"):
            EngineCoreConfig(**{field: value})


def test_engine_open_validates_settings_before_loading():
    from ninfer_jax import Engine
    from ninfer_jax.errors import ConfigError

    # page_size=0 used to divide by zero while deriving the default pool size.
    for settings, field in [({"page_size": 0}, "page_size"), ({"max_seq_len": "2k"}, "max_seq_len"),
                            ({"max_queue": -1}, "max_queue"), ({"pages": 3}, "unknown")]:
        with pytest.raises(ConfigError, match=field):
            Engine.open("/nonexistent/model", **settings)


def test_messages_with_bad_content_are_refused_with_the_field():
    from ninfer_jax.frontend import ChatTemplate, Frontend, PromptError
    from tests.engine.conftest import TOKENIZER

    frontend = Frontend(TOKENIZER, ChatTemplate("{% for m in messages %}{{ m.content }}"
                                                "{% endfor %}"))
    for content, field in [(None, "messages[0].content"), (5, "messages[0].content"),
                           ([{"type": "image"}], "messages[0].content[0]")]:
        with pytest.raises(PromptError) as e:
            frontend.prepare(messages=[{"role": "user", "content": content}])
        assert e.value.field == field
    parts = [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]
    assert frontend.prepare(messages=[{"role": "user", "content": parts}]).text == "abc"
    tool_call = {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}
    assert frontend.prepare(messages=[{"role": "user", "content": "q"}, tool_call]).text == "q"


def test_prefix_reuse_never_crosses_cache_scopes():
    from tests.engine.test_prefix import engine, submit

    ids = list(range(40, 80))
    follow_up = ids + [90, 91, 92]  # extends the first prompt: its checkpoint would serve it
    with engine() as (core, _):
        def run(tokens, scope, session=None):
            sp = SamplingParams(temperature=0.0, max_new_tokens=3)
            h = core.submit(FRONTEND.prepare(prompt_token_ids=tokens), sp, cache_scope=scope,
                            session_key=session)
            return h.result(timeout=10)

        assert run(ids, "tenant-a", session="s").usage.cached_tokens == 0
        # Another tenant (even with the same session key) and the default scope learn nothing.
        other = run(follow_up, "tenant-b", session="s")
        assert other.usage.cached_tokens == 0
        assert run(follow_up, None).usage.cached_tokens == 0
        again = run(follow_up, "tenant-a")
        assert again.usage.cached_tokens == prompt_checkpoint(len(ids))
        assert again.token_ids == other.token_ids
        # Within the default scope its own prefix does hit (else this test would be vacuous).
        hit = submit(core, follow_up + [94], 3).result(timeout=10)
        assert hit.usage.cached_tokens == prompt_checkpoint(len(follow_up))


def test_structured_output_refuses_min_tokens_and_ignore_eos():
    """The grammar allows EOS exactly where its text is complete: a floor on the output's
    length or ignoring EOS would contradict it, so both are refused naming the field."""
    spec = StructuredOutput("regex", "a+")
    for field in ({"min_tokens": 2}, {"ignore_eos": True}):
        with pytest.raises(SamplingParamsError, match=f"^{next(iter(field))} cannot"):
            SamplingParams(max_new_tokens=8, structured=spec, **field)
    SamplingParams(max_new_tokens=8, structured=spec, stop=("b",))  # other fields still work
