"""The `engine` suite's default: the Engine against its own Program on the embedded demo model,
and the README main job's time to first token from a cold and a warm compilation cache.

Both sides are ours, so they share one process (`_abab.LocalSide`) and alternate repetitions:

- Engine: `Engine.open()` (the public API; prefix reuse off, verification off), C requests
  submitted at once with the same prompt token ids, greedy, NEW_TOKENS each; a repetition runs
  from the first submit to the last result. tok/s = generated tokens / seconds.
- Program: a second Program with the same ProgramConfig, driven through its public API with no
  Engine: admit the same C prompts, prefill each, then decode + commit rounds on all C rows until
  each has NEW_TOKENS, then release. The same work, so Engine/Program is the cost of the Engine.
- round: the Program's B=1 round, one `decode` + `commit` (ROUND_STEPS rounds per repetition on a
  prefilled sequence); reported in ms per round.

The prompts are story openings whose greedy continuation holds no EOS within NEW_TOKENS, so
every request generates exactly NEW_TOKENS; the suite checks that the Engine's tokens equal the
Program's, row by row, in every repetition.

The start-up measurement runs `ninfer generate --prompt="Once upon a time"` as a subprocess
with NINFER_JAX_CACHE_DIR set to a new empty directory (cold), then again with it (warm), and
records the seconds from starting the process to the first byte of the answer on stdout.
"""

from __future__ import annotations

import os
import pathlib
import select
import subprocess
import sys
import tempfile
import time

from scripts.benchmarks._abab import (
    REPO,
    LocalSide,
    alternate,
    fmt_spread,
    progress,
    spread,
    strip_outputs,
)
from scripts.benchmarks._env import env_int, env_ints

NEW_TOKENS = 128
ROUND_STEPS = 16
MAX_SEQ_LEN = 512
PROMPTS = (
    "Once upon a time, there was a little girl named Lily.", "Tom had a big red ball.",
    "One day, a small bird", "Anna liked to draw pictures of cats.",
    "Ben and Mia went to the park to play.", "There was a big tree in the garden.",
    "Sam wanted a new toy for his birthday.", "The cat sat by the window and looked at the rain.",
)
MAIN_JOB = ("generate", "--prompt=Once upon a time")


class EngineSide:
    """C requests through the public Engine, all submitted before the first result is read."""

    def __init__(self, engine, new_tokens: int):
        from ninfer_jax.sampling_params import SamplingParams

        self.engine = engine
        self.sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)

    def prepare(self, name: str, args: dict) -> None:
        self.prompts = args["prompts"]

    def rep(self, name: str) -> dict:
        start = time.perf_counter()
        handles = [self.engine.submit(prompt_token_ids=p, sampling=self.sampling)
                   for p in self.prompts]
        tokens = [list(h.result().token_ids) for h in handles]
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "work": sum(map(len, tokens)), "outputs": tokens}

    def finish(self, name: str) -> None:
        pass


class ProgramSide:
    """The same requests' work on a Program directly: admit, prefill, decode + commit rounds."""

    def __init__(self, program, new_tokens: int):
        self.program, self.new_tokens = program, new_tokens

    def prepare(self, name: str, args: dict) -> None:
        self.prompts = args["prompts"]

    def _prefill(self, handle) -> None:
        while (batch := self.program.prefill(handle)) is None:
            pass
        self.program.commit(batch, [1])

    def rep(self, name: str) -> dict:
        prog, n = self.program, self.new_tokens
        start = time.perf_counter()
        handles = [prog.materialize(prog.plan_admission(len(p), n), p) for p in self.prompts]
        for h in handles:
            self._prefill(h)
        for _ in range(n - 1):
            prog.commit(prog.decode(handles), [1] * len(handles))
        tokens = [prog.tokens(h)[len(p):] for h, p in zip(handles, self.prompts)]
        for h in handles:
            prog.release(h)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "work": sum(map(len, tokens)), "outputs": tokens}

    def finish(self, name: str) -> None:
        pass


class RoundSide(ProgramSide):
    """The Program's B=1 round: ROUND_STEPS decode + commit rounds on one prefilled sequence."""

    def prepare(self, name: str, args: dict) -> None:
        prog, (prompt,) = self.program, args["prompts"]
        self.handle = prog.materialize(prog.plan_admission(len(prompt), self.new_tokens), prompt)
        self._prefill(self.handle)

    def rep(self, name: str) -> dict:
        prog, handle = self.program, self.handle
        start = time.perf_counter()
        for _ in range(ROUND_STEPS):
            prog.commit(prog.decode([handle]), [1])
        return {"seconds": time.perf_counter() - start, "work": ROUND_STEPS}

    def finish(self, name: str) -> None:
        self.program.release(self.handle)


def compare(levels: tuple[int, ...], reps: int, warmup: int) -> dict:
    """Engine vs Program tok/s at each C in `levels`, and the Program's B=1 round."""
    from ninfer_jax.api import Engine
    from ninfer_jax.program.program import Program

    if max(levels) > len(PROMPTS):
        raise ValueError(f"concurrency levels must be <= {len(PROMPTS)}, got {levels}")
    max_c = max(levels)
    start = time.perf_counter()
    engine = Engine.open(None, max_concurrency=max_c, verify_weights=False, prefix_reuse=False,
                         max_seq_len=MAX_SEQ_LEN)
    out = {"engine_open_s": time.perf_counter() - start}
    try:
        core_program = engine.core.program
        start = time.perf_counter()
        program = Program(core_program.cfg, core_program.params, core_program.pcfg)
        out["program_build_s"] = time.perf_counter() - start
        # Both compile their exact-B executables on a background thread; a measurement taken
        # while they compile times the compiler (the first C=1 turns ran 5-10x slower).
        core_program.wait_compiled()
        program.wait_compiled()
        prompts = [list(engine.frontend.prepare(prompt=p).token_ids) for p in PROMPTS]
        engine_side = LocalSide("engine", EngineSide(engine, NEW_TOKENS))
        program_side = LocalSide("program", ProgramSide(program, NEW_TOKENS))
        out["levels"] = {}
        for c in levels:
            progress(f"demo: Engine vs Program at C={c}")
            r = alternate([engine_side, program_side], f"c{c}", {"prompts": prompts[:c]},
                          reps=reps, warmup=warmup)
            e, p = r["sides"]["engine"], r["sides"]["program"]
            runs = e["warmup_outputs"] + e["outputs"], p["warmup_outputs"] + p["outputs"]
            r["identical_tokens"] = runs[0] == runs[1]
            r["tokens_per_request"] = sorted({len(t) for rep in runs[0] for t in rep})
            out["levels"][c] = strip_outputs(r)
        progress("demo: the Program's B=1 round")
        rounds = 1 + ROUND_STEPS * (warmup + reps)
        r = alternate([LocalSide("program", RoundSide(program, rounds))], "round_b1",
                      {"prompts": prompts[:1]}, reps=reps, warmup=warmup)
        ms = [1000 / rate for rate in r["sides"]["program"]["rates"]]
        out["round_b1"] = {"ms": spread(ms), "load_1min": r["load_1min"]}
    finally:
        engine.close()
    return out


def first_token_seconds(cache_dir: str, timeout_s: float) -> dict:
    """Runs the README main job; seconds from starting it to the first answer byte, and total."""
    ninfer = pathlib.Path(sys.executable).parent / "ninfer"
    if not ninfer.is_file():
        raise FileNotFoundError(f"{ninfer}: the `ninfer` console script is not installed next "
                                f"to this Python (pip install -e .)")
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "NINFER_JAX_CACHE_DIR": cache_dir, "PYTHONPATH": path}
    start = time.perf_counter()
    proc = subprocess.Popen([str(ninfer), *MAIN_JOB], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
        if not ready or not proc.stdout.read(1):
            raise RuntimeError(f"`ninfer {' '.join(MAIN_JOB)}` wrote no answer within "
                               f"{timeout_s:g} s (status {proc.poll()})")
        first = time.perf_counter() - start
        _, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    total = time.perf_counter() - start
    if proc.returncode != 0:
        tail = err.decode("utf-8", "replace")[-2000:]
        raise RuntimeError(f"`ninfer {' '.join(MAIN_JOB)}` exited with status "
                           f"{proc.returncode}; stderr tail:\n{tail}")
    return {"first_token_s": first, "total_s": total}


def startup(timeout_s: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="ninfer_bench_cold_cache_") as cache:
        progress("demo: README main job, cold compilation cache")
        before = os.getloadavg()
        cold = first_token_seconds(cache, timeout_s)
        progress("demo: README main job, warm compilation cache")
        warm = first_token_seconds(cache, timeout_s)
    return {"command": ["ninfer", *MAIN_JOB], "cold": cold, "warm": warm,
            "load_before": before, "load_after": os.getloadavg()}


def run_demo() -> dict:
    """Settings (environment): BENCH_ENGINE_LEVELS=1,8  BENCH_ENGINE_REPS=5
    BENCH_ENGINE_WARMUP=1  BENCH_ENGINE_STARTUP=1 (0 skips the cold/warm start-up runs)
    BENCH_TIMEOUT_S=1800."""
    levels = env_ints("BENCH_ENGINE_LEVELS", (1, 8), maximum=len(PROMPTS))
    reps = env_int("BENCH_ENGINE_REPS", 5)
    warmup = env_int("BENCH_ENGINE_WARMUP", 1, minimum=0)
    with_startup = env_int("BENCH_ENGINE_STARTUP", 1, minimum=0, maximum=1)
    timeout_s = env_int("BENCH_TIMEOUT_S", 1800)
    result = {"model": "demo", "new_tokens": NEW_TOKENS, "reps": reps, "warmup": warmup,
              "load_average_start": os.getloadavg()}
    result["comparison"] = compare(levels, reps, warmup)
    if with_startup:
        result["startup"] = startup(timeout_s)
    result["load_average_end"] = os.getloadavg()
    result["table"] = format_demo(result)
    print(result["table"])
    return result


def format_demo(result: dict) -> str:
    cmp = result["comparison"]
    lines = [(f"demo model, {result['new_tokens']} new tokens per request, greedy; Engine.open "
              f"{cmp['engine_open_s']:.1f} s, second Program {cmp['program_build_s']:.1f} s"),
             (f"{'C':>3}{'Engine tok/s':>24}{'Program tok/s':>24}{'Engine/Program':>20}"
              f"{'same tokens':>13}{'load 1-min':>13}")]
    for c, r in cmp["levels"].items():
        e, p = r["sides"]["engine"]["rate"], r["sides"]["program"]["rate"]
        load = r["load_1min"]
        lines.append(f"{c:>3}{fmt_spread(e):>24}{fmt_spread(p):>24}"
                     f"{fmt_spread(r['ratios']['engine/program'], 2):>20}{r['identical_tokens']!s:>13}"
                     f"{load['min']:>7.1f}-{load['max']:<5.1f}")
    rb = cmp["round_b1"]
    lines.append(f"Program B=1 round (decode + commit): {fmt_spread(rb['ms'], 2)} ms "
                 f"(load {rb['load_1min']['min']:.1f}-{rb['load_1min']['max']:.1f})")
    for c, r in cmp["levels"].items():
        got = r["ratios"]["engine/program"]["median"]
        lines.append(f"target Engine/Program >= 0.85 at C={c}: {got:.2f} "
                     f"({'met' if got >= 0.85 else 'NOT met'})")
    if "startup" in result:
        s = result["startup"]
        lines.append(f"`{' '.join(s['command'])}`: first token {s['cold']['first_token_s']:.1f} s "
                     f"cold (exit {s['cold']['total_s']:.1f} s), "
                     f"{s['warm']['first_token_s']:.1f} s warm (exit {s['warm']['total_s']:.1f} s)"
                     f"; load {s['load_before'][0]:.1f} -> {s['load_after'][0]:.1f}")
        cold = s["cold"]["first_token_s"]
        lines.append(f"target first token <= 15 s from a cold cache: {cold:.1f} s "
                     f"({'met' if cold <= 15 else 'NOT met'})")
    return "\n".join(lines)
