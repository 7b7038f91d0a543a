"""Engine test set-up: the FakeProgram (hand-computable model) behind a real EngineCore."""

from __future__ import annotations

import contextlib
import time

from ninfer_jax.engine import EngineCore, EngineCoreConfig, EngineStats
from ninfer_jax.frontend import Frontend
from ninfer_jax.program.limits import ProgramLimits
from ninfer_jax.sampling_params import SamplingParams
from ninfer_jax.testing.fake_program import FakeProgram, expected_tokens
from ninfer_jax.testing.tokenizer import ByteTokenizer

TOKENIZER = ByteTokenizer()
FRONTEND = Frontend(TOKENIZER)
EOS = TOKENIZER.special_id("<|im_end|>")
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)


def limits(max_concurrency: int, **kw) -> ProgramLimits:
    base = {"max_seq_len": 96, "page_size": 4, "total_pages": 24 * max_concurrency,
            "total_slots": max_concurrency, "max_concurrency": max_concurrency,
            "prefill_chunk": 8, "vocab_size": TOKENIZER.vocab_size}
    return ProgramLimits(**{**base, **kw})


def prompt_checkpoint(n: int, chunk: int = 8) -> int:
    """Where a prompt of n tokens leaves its checkpoint (no chat boundary, a request of more
    than one token): at the start of its last prefill chunk when it spans several (so the same
    prompt again runs only that chunk), else at its end."""
    return (n - 1) // chunk * chunk if n > chunk else n


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


def want(text: str, max_new: int, seed: int = 0) -> list[int]:
    """What the FakeProgram generates for `text` alone."""
    return expected_tokens(list(prompt(text).token_ids), max_new, seed=seed,
                           vocab_size=TOKENIZER.vocab_size, eos_id=EOS)


def long_prompt(num_tokens: int, tag: str = "long") -> str:
    """A prompt whose fake continuation runs `num_tokens` without hitting EOS."""
    return next(t for t in (f"{tag} {i}" for i in range(1000))
                if len(want(t, num_tokens)) == num_tokens)


def _next_stats(core: EngineCore, seen: EngineStats, deadline: float) -> EngineStats:
    """The first stats the worker publishes after `seen` (it publishes after every iteration,
    idle ones too, until it stops)."""
    while (s := core.stats()) is seen:
        if not s.available:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"the worker published no stats for a while: hung? {s}")
        time.sleep(0.001)
    return s


def settle(core: EngineCore, timeout_s: float = 30.0) -> EngineStats:
    """Engine stats once the worker has nothing left to do. Call it after every consumer is
    done (handles read to the end, released or dropped).

    Two publications after the call began cover every submit, cancel and drop made before it.
    While requests are waiting or active the worker has work and progresses: look again. Once
    none is, nothing can change any more, so the stats are returned at once: capacity still
    outstanding then is a leak, seen without waiting for a timeout (`timeout_s` bounds only a
    worker that stops making progress)."""
    deadline = time.monotonic() + timeout_s
    s = core.stats()
    while True:
        s = _next_stats(core, _next_stats(core, s, deadline), deadline)
        if not s.available or (s.waiting == 0 and s.active == 0):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"requests still waiting or active after {timeout_s} s: {s}")
