"""The Engine's control-plane cost per decode round against the size of its checkpoint catalog.

    python scripts/bench.py --suite=control_plane

Two EngineCores over the FakeProgram (real bookkeeping, a model that costs microseconds), one
holding BENCH_CP_SMALL (10) inactive prefix checkpoints and one BENCH_CP_LARGE (10,000), each
made by real requests. In each repetition, on each engine in turn (ABAB): one incumbent request
decodes while the FIFO head waits, blocked by the incumbent's reservation (no eviction could
make it fit); the round rate over BENCH_CP_WINDOW_MS is the control plane's rate, since the fake
model's step is nearly free. DESIGN §4: admission is rechecked only when a fact that decides it
changes, so the rate must not depend on the catalog (target: within 10%). Both engines live in
this process (no XLA, no torch), and only one has work at a time.
"""

from __future__ import annotations

import os
import statistics
import time

from ninfer_jax.engine import EngineCore, EngineCoreConfig
from ninfer_jax.frontend import ChatTemplate, Frontend
from ninfer_jax.program.limits import ProgramLimits
from ninfer_jax.sampling_params import SamplingParams
from ninfer_jax.testing.fake_program import FakeProgram
from ninfer_jax.testing.tokenizer import ByteTokenizer
from scripts.benchmarks._env import env_int

PAGE = 16
MAX_PAGES = 11_000  # per sequence: the head asks for all of them
FRONTEND = Frontend(ByteTokenizer(), ChatTemplate("{{ messages[0].content }}"))


def _limits(checkpoints: int) -> ProgramLimits:
    # Pages: one per checkpoint, the incumbent's ~6,000, and the head's 11,000 never fit
    # beside the incumbent even with every checkpoint evicted.
    return ProgramLimits(
        max_seq_len=PAGE * MAX_PAGES, page_size=PAGE, total_pages=max(checkpoints, 10_000) + 6_500,
        total_slots=3, max_concurrency=3, prefill_chunk=64,
        vocab_size=FRONTEND.tokenizer.vocab_size, total_checkpoint_slots=checkpoints + 64)


def _engine(checkpoints: int) -> EngineCore:
    program = FakeProgram(_limits(checkpoints), eos_id=None)
    core = EngineCore(program, FRONTEND, EngineCoreConfig(max_queue=256, idle_wait_s=0.01))
    one = SamplingParams(max_new_tokens=1, temperature=0)
    pending = []
    for i in range(checkpoints):  # one 16-token prompt, one checkpoint, per request
        pending.append(core.submit(FRONTEND.prepare(prompt=f"{i:015d}\n"), one))
        if len(pending) == 200:
            for h in pending:
                h.result(timeout=120)
            pending.clear()
    for h in pending:
        h.result(timeout=120)
    got = core.stats().prefix.checkpoints
    if got != checkpoints:
        raise RuntimeError(f"populated {got} checkpoints, wanted {checkpoints}")
    return core


def _wait(cond, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.001)


def _rounds_per_s(core: EngineCore, rep: int, window_s: float) -> float:
    """The incumbent's decode rate while the head is blocked."""
    incumbent = core.submit(FRONTEND.prepare(prompt=f"incumbent {rep:06d}"),
                            SamplingParams(max_new_tokens=PAGE * 6_000, temperature=0))
    _wait(lambda: core.stats().generated_tokens > 0 and core.stats().active == 1, "incumbent")
    head = core.submit(FRONTEND.prepare(prompt=f"head {rep:06d}"),
                       SamplingParams(max_new_tokens=PAGE * MAX_PAGES - 32, temperature=0))
    _wait(lambda: core.stats().waiting == 1, "the head to wait")
    time.sleep(0.05)  # the head's first admission attempts are done
    start_tokens, start = core.stats().generated_tokens, time.perf_counter()
    time.sleep(window_s)
    tokens, elapsed = core.stats().generated_tokens - start_tokens, time.perf_counter() - start
    if core.stats().waiting != 1:
        raise RuntimeError("the head was admitted: the set-up does not block it")
    head.cancel()
    incumbent.cancel()
    for h in (head, incumbent):
        h.result(timeout=30)  # cancelled
    return tokens / elapsed


def run(out_dir: str) -> dict:
    del out_dir
    small = env_int("BENCH_CP_SMALL", 10)
    large = env_int("BENCH_CP_LARGE", 10_000)
    reps = env_int("BENCH_CP_REPS", 5)
    window_s = env_int("BENCH_CP_WINDOW_MS", 500) / 1000
    start = time.perf_counter()
    engines = {small: _engine(small), large: _engine(large)}
    populate_s = time.perf_counter() - start
    rates: dict[int, list[float]] = {n: [] for n in engines}
    try:
        for rep in range(reps):
            for n, core in engines.items():  # in turn: A B A B ...
                rates[n].append(_rounds_per_s(core, rep, window_s))
    finally:
        for core in engines.values():
            core.close()
    ratios = [a / b for a, b in zip(rates[large], rates[small])]
    result = {
        "populate_s": round(populate_s, 1), "load_avg": os.getloadavg(),
        "rounds_per_s": {str(n): {"median": statistics.median(r), "min": min(r), "max": max(r)}
                         for n, r in rates.items()},
        "large_over_small": {"median": statistics.median(ratios), "min": min(ratios),
                             "max": max(ratios)},
    }
    print(f"control plane, decode rounds/s with a blocked head ({reps} reps of "
          f"{window_s * 1000:.0f} ms, in turn; populated in {populate_s:.1f} s; load "
          f"{result['load_avg'][0]:.2f})")
    print("| checkpoints | rounds/s median [min-max] | us/round |")
    print("|---|---|---|")
    for n, r in rates.items():
        med = statistics.median(r)
        print(f"| {n:,} | {med:,.0f} [{min(r):,.0f}-{max(r):,.0f}] | {1e6 / med:.0f} |")
    m = result["large_over_small"]
    print(f"{large:,} / {small:,}: {m['median']:.3f} [{m['min']:.3f}-{m['max']:.3f}] "
          "(target >= 0.90)")
    return result
