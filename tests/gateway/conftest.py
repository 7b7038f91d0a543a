"""Gateway test set-up: a real uvicorn server on 127.0.0.1 (a free port) over an Engine whose
Program is the FakeProgram (hand-computable model, real bookkeeping) and whose Frontend is the
ByteTokenizer with a small ChatML template."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from ninfer_jax.api import Engine
from ninfer_jax.engine import EngineCore, EngineCoreConfig
from ninfer_jax.frontend import ChatTemplate, Frontend
from ninfer_jax.gateway.server import ServerThread, create_app
from ninfer_jax.program.limits import ProgramLimits
from ninfer_jax.testing.fake_program import FakeProgram
from ninfer_jax.testing.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
CHATML = ChatTemplate(
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking %}<think>\n{% endif %}{% endif %}")
FRONTEND = Frontend(TOKENIZER, CHATML)
EOS = TOKENIZER.special_id("<|im_end|>")
THINK_START, THINK_END = TOKENIZER.think_ids
MODEL = "fake-model"
PAGE_SIZE = 16


class ThinkingFakeProgram(FakeProgram):
    """The FakeProgram, plus: when the prompt leaves `<think>` open, the 4th generated token
    closes it, so answers carry both a reasoning and a content part."""

    def _token(self, seq, last: int, position: int) -> int:
        if position == seq.prompt_len + 3 and THINK_START in seq.tokens[seq.prompt_len - 2:seq.prompt_len]:
            return THINK_END
        return super()._token(seq, last, position)


def make_engine(max_concurrency: int = 4, *, max_queue: int = 64, max_seq_len: int = 512,
                step_seconds: float = 0.0, eos: bool = True, checkpoints: int = 8,
                verify_width: int = 1, round_drafts: tuple[int, ...] | None = None,
                frontend: Frontend = FRONTEND, **program_kw) -> Engine:
    """An Engine over the (thinking) FakeProgram with prefix reuse (`checkpoints` slots);
    `eos=False`: answers run to their budget; `verify_width` > 1: speculative rounds of up to
    that many tokens (`round_drafts`: the draft counts the draft policy may choose)."""
    limits = ProgramLimits(
        max_seq_len=max_seq_len, page_size=PAGE_SIZE,
        total_pages=max_concurrency * (max_seq_len // PAGE_SIZE), total_slots=max_concurrency,
        max_concurrency=max_concurrency, prefill_chunk=64, vocab_size=TOKENIZER.vocab_size,
        total_checkpoint_slots=checkpoints, verify_width=verify_width,
        rewrites_below_frontier=int(verify_width > 1), round_drafts=round_drafts)
    program = ThinkingFakeProgram(limits, eos_id=EOS if eos else None, step_seconds=step_seconds, **program_kw)
    core = EngineCore(program, frontend, EngineCoreConfig(max_queue=max_queue, idle_wait_s=0.01))
    return Engine(core, frontend, None)


@contextlib.contextmanager
def served(engine: Engine, *, limits: dict | None = None, **app_kw) -> Iterator[ServerThread]:
    """The engine behind a live server (`limits`: ServerThread's connection limits); the engine
    is closed afterwards."""
    try:
        with ServerThread(create_app(engine, model_name=MODEL, **app_kw),
                          **(limits or {})) as server:
            yield server
    finally:
        engine.close()


def wait_idle(engine: Engine, timeout_s: float = 10.0):
    """Engine stats once nothing is outstanding (bounded wait); the caller asserts on them."""
    deadline = time.monotonic() + timeout_s
    stats = engine.stats()
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.outstanding == 0 and stats.active == 0 and stats.waiting == 0:
            break
        time.sleep(0.02)
    return stats


def assert_fully_free(engine: Engine) -> None:
    """Nothing outstanding; once the prefix cache is dropped, every lane, page, slot free."""
    s = wait_idle(engine)
    assert (s.outstanding, s.active, s.waiting) == (0, 0, 0), s
    engine.core.clear_prefix_cache()
    s = wait_idle(engine)
    assert s.prefix.checkpoints == 0, s
    assert s.free_lanes == s.total_lanes, s
    assert s.free_pages == s.total_pages and s.reserved_pages == 0, s
    assert s.free_slots == s.total_slots, s
    assert s.available, s


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    """A shared server: max_concurrency 4, steps of 1 ms so streams take a little while."""
    with served(make_engine(step_seconds=0.001)) as s:
        yield s


@pytest.fixture
def engine_of():
    def get(server: ServerThread) -> Engine:
        return server.server.config.app.state.server.engine
    return get
