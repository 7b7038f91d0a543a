"""Engine test set-up: the FakeProgram (hand-computable model) behind a real EngineCore."""

from __future__ import annotations

import contextlib

from ninfer_jax.engine import EngineCore, EngineCoreConfig
from ninfer_jax.frontend import Frontend
from ninfer_jax.program.host import ProgramLimits
from ninfer_jax.testing.fake_program import FakeProgram
from ninfer_jax.testing.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
FRONTEND = Frontend(TOKENIZER)
EOS = TOKENIZER.special_id("<|im_end|>")


def limits(max_concurrency: int, **kw) -> ProgramLimits:
    base = dict(max_seq_len=96, page_size=4, total_pages=24 * max_concurrency,
                total_slots=max_concurrency, max_concurrency=max_concurrency, prefill_chunk=8,
                vocab_size=TOKENIZER.vocab_size)
    return ProgramLimits(**{**base, **kw})


@contextlib.contextmanager
def fake_engine(max_concurrency: int = 3, *, max_queue: int = 64, program_kw=None, **limit_kw):
    program = FakeProgram(limits(max_concurrency, **limit_kw), eos_id=EOS, **(program_kw or {}))
    core = EngineCore(program, FRONTEND, EngineCoreConfig(max_queue=max_queue, idle_wait_s=0.01))
    try:
        yield core, program
    finally:
        core.close()


def prompt(text: str):
    return FRONTEND.prepare(prompt=text)
