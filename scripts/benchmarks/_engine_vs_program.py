"""The `engine` suite's default: what a user of the embedded demo model gets, against its own
Program on the same run.

Both in-process sides are ours, so they share one process (`_abab.LocalSide`) and alternate
repetitions:

- Engine: `Engine.open()` (the public API; prefix reuse off, verification off), C requests
  submitted at once with the same prompt token ids, NEW_TOKENS each (greedy, and at C = 1 also
  sampled: temperature 0.8, top-p 0.95, fixed seeds, EOS ignored); a repetition runs from the
  first submit to the last result. tok/s = generated tokens / seconds. Each repetition also
  reads the Engine's `stats().rounds`: the worker's host microseconds per decode round and per
  row (its time in decode iterations less the time it waited for a round's tokens), and the
  share of a round it waited (the device was behind the host).
- Program: a second Program with the same ProgramConfig, driven through its public API with no
  Engine: admit the same C prompts, prefill each, then decode + commit rounds on all C rows until
  each has NEW_TOKENS, then release. The same work, so Engine/Program is the cost of the Engine.
- round: the Program's B=1 round, one `decode` + `commit` (ROUND_STEPS rounds per repetition on a
  prefilled sequence), greedy and sampled; reported in ms per round.

The prompts are story openings whose greedy continuation holds no EOS within NEW_TOKENS, so
every request generates exactly NEW_TOKENS; the suite checks that the Engine's tokens equal the
Program's, row by row, in every repetition.

The README main job, as the user runs it: `ninfer generate --prompt="Once upon a time"`
(streamed, sampled, 256 new tokens at most) as a subprocess, with NINFER_JAX_CACHE_DIR a new
empty directory (cold, once), then the same directory (warm, alternated with the Program's B=1
sampled round). Its stdout is read as it streams: seconds from starting the process to the
first answer byte and to the last, from the last to the process's exit, and the streamed tok/s
(tokens after the first over the seconds between the first and last byte; the token count is
the job's own summary line).
"""

from __future__ import annotations

import os
import pathlib
import re
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
SAMPLED = {"temperature": 0.8, "top_p": 0.95}  # the command line's defaults
ROUND_STEPS = 16
MAX_SEQ_LEN = 512
PROMPTS = (
    "Once upon a time, there was a little girl named Lily.", "Tom had a big red ball.",
    "One day, a small bird", "Anna liked to draw pictures of cats.",
    "Ben and Mia went to the park to play.", "There was a big tree in the garden.",
    "Sam wanted a new toy for his birthday.", "The cat sat by the window and looked at the rain.",
)
MAIN_JOB = ("generate", "--prompt=Once upon a time")


def _sampling(kind: str, new_tokens: int, row: int):
    """Greedy, or the command line's sampling with a fixed seed per row (EOS ignored, so both
    sides generate every token)."""
    from ninfer_jax.sampling_params import SamplingParams

    if kind == "greedy":
        return SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    return SamplingParams(**SAMPLED, seed=1000 + row, max_new_tokens=new_tokens, ignore_eos=True)


class EngineSide:
    """C requests through the public Engine, all submitted before the first result is read."""

    def __init__(self, engine, new_tokens: int):
        self.engine, self.new_tokens = engine, new_tokens

    def prepare(self, name: str, args: dict) -> None:
        self.prompts, self.kind = args["prompts"], args["sampling"]
        self.host: list[dict] = []  # per repetition, warm-up first

    def rep(self, name: str) -> dict:
        before = self.engine.stats().rounds
        start = time.perf_counter()
        handles = [self.engine.submit(prompt_token_ids=p,
                                      sampling=_sampling(self.kind, self.new_tokens, i))
                   for i, p in enumerate(self.prompts)]
        tokens = [list(h.result().token_ids) for h in handles]
        seconds = time.perf_counter() - start
        after = self.engine.stats().rounds
        rounds, rows = after.rounds - before.rounds, after.rows - before.rows
        host, wait = after.host_s - before.host_s, after.wait_s - before.wait_s
        self.host.append({"us_per_round": 1e6 * host / max(rounds, 1),
                          "us_per_row": 1e6 * host / max(rows, 1),
                          "wait_share": wait / max(host + wait, 1e-12)})
        return {"seconds": seconds, "work": sum(map(len, tokens)), "outputs": tokens}

    def finish(self, name: str) -> None:
        pass


class ProgramSide:
    """The same requests' work on a Program directly: admit, prefill, decode + commit rounds."""

    def __init__(self, program, new_tokens: int):
        self.program, self.new_tokens = program, new_tokens

    def prepare(self, name: str, args: dict) -> None:
        self.prompts, self.kind = args["prompts"], args["sampling"]

    def _prefill(self, handle) -> None:
        while (batch := self.program.prefill(handle)) is None:
            pass
        self.program.commit(batch, [1])

    def rep(self, name: str) -> dict:
        prog, n = self.program, self.new_tokens
        start = time.perf_counter()
        handles = [prog.materialize(prog.plan_admission(len(p), n), p,
                                    _sampling(self.kind, n, i))
                   for i, p in enumerate(self.prompts)]
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
        self.handle = prog.materialize(prog.plan_admission(len(prompt), self.new_tokens), prompt,
                                       _sampling(args["sampling"], self.new_tokens, 0))
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
    """Engine vs Program tok/s at each C in `levels` (greedy; C = 1 sampled too), and the
    Program's B=1 round, greedy and sampled."""
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
        cases = [(f"c{c}", c, "greedy") for c in levels] + [("c1_sampled", 1, "sampled")]
        for key, c, kind in cases:
            progress(f"demo: Engine vs Program at C={c}, {kind}")
            r = alternate([engine_side, program_side], key,
                          {"prompts": prompts[:c], "sampling": kind}, reps=reps, warmup=warmup)
            e, p = r["sides"]["engine"], r["sides"]["program"]
            runs = e["warmup_outputs"] + e["outputs"], p["warmup_outputs"] + p["outputs"]
            r["identical_tokens"] = runs[0] == runs[1]
            r["tokens_per_request"] = sorted({len(t) for rep in runs[0] for t in rep})
            r["concurrency"], r["sampling"] = c, kind
            timed = engine_side._impl.host[warmup:]
            r["host"] = {k: spread([h[k] for h in timed]) for k in timed[0]}
            out["levels"][key] = strip_outputs(r)
        for kind in ("greedy", "sampled"):
            progress(f"demo: the Program's B=1 round, {kind}")
            rounds = 1 + ROUND_STEPS * (warmup + reps)
            r = alternate([LocalSide("program", RoundSide(program, rounds))], f"round_b1_{kind}",
                          {"prompts": prompts[:1], "sampling": kind}, reps=reps, warmup=warmup)
            ms = [1000 / rate for rate in r["sides"]["program"]["rates"]]
            out[f"round_b1_{kind}"] = {"ms": spread(ms), "load_1min": r["load_1min"]}
    finally:
        engine.close()
    return out


class MainJobSide:
    """The README main job as a subprocess, its stdout read as it streams (one repetition: one
    process, from start to exit). Work: the tokens after the first; seconds: from the first
    answer byte to the last."""

    def __init__(self, cache_dir: str, timeout_s: float):
        self.cache_dir, self.timeout_s = cache_dir, timeout_s
        self.runs: list[dict] = []

    def prepare(self, name: str, args: dict) -> None:
        self.runs = []

    def rep(self, name: str) -> dict:
        run = main_job(self.cache_dir, self.timeout_s)
        self.runs.append(run)
        return {"seconds": run["last_token_s"] - run["first_token_s"],
                "work": max(run["tokens"] - 1, 1)}

    def finish(self, name: str) -> None:
        pass


_SUMMARY = re.compile(rb"\[ninfer\] 1 requests, (\d+) tokens in")


def main_job(cache_dir: str, timeout_s: float) -> dict:
    """Runs the README main job once: seconds from starting the process to its first and last
    answer byte and to its exit, and the tokens it generated (its summary line)."""
    ninfer = pathlib.Path(sys.executable).parent / "ninfer"
    if not ninfer.is_file():
        raise FileNotFoundError(f"{ninfer}: the `ninfer` console script is not installed next "
                                f"to this Python (pip install -e .)")
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "NINFER_JAX_CACHE_DIR": cache_dir, "PYTHONPATH": path}
    start = time.perf_counter()
    proc = subprocess.Popen([str(ninfer), *MAIN_JOB], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = last = None
    err = b""
    try:
        fds = {proc.stdout.fileno(): "out", proc.stderr.fileno(): "err"}
        while fds:
            left = timeout_s - (time.perf_counter() - start)
            ready, _, _ = select.select(list(fds), [], [], max(left, 0))
            if not ready:
                raise RuntimeError(f"`ninfer {' '.join(MAIN_JOB)}` did not finish within "
                                   f"{timeout_s:g} s")
            for fd in ready:
                chunk = os.read(fd, 65536)
                now = time.perf_counter() - start
                if not chunk:
                    del fds[fd]
                elif fds[fd] == "out":
                    if chunk.strip():
                        first = now if first is None else first
                        last = now
                else:
                    err += chunk
        proc.wait(timeout=timeout_s)
        ended = time.perf_counter() - start
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    if proc.returncode != 0 or first is None:
        tail = err.decode("utf-8", "replace")[-2000:]
        raise RuntimeError(f"`ninfer {' '.join(MAIN_JOB)}` exited with status "
                           f"{proc.returncode} (answer bytes: {first is not None}); stderr "
                           f"tail:\n{tail}")
    found = _SUMMARY.search(err)
    if found is None:
        raise RuntimeError(f"no summary line in the main job's stderr: {err[-500:]!r}")
    tokens = int(found.group(1))
    return {"first_token_s": first, "last_token_s": last, "exit_s": ended,
            "exit_after_last_s": ended - last, "tokens": tokens,
            "streamed_tok_s": (tokens - 1) / max(last - first, 1e-9)}


def main_job_program():
    """A Program as the main job's Engine builds it (the command line's default max_concurrency
    and max_seq_len: the attention reads every page a row may hold), and the job's prompt ids."""
    from ninfer_jax.api import Engine
    from ninfer_jax.gateway import generate
    from ninfer_jax.program.program import Program

    flags = generate.FLAGS
    engine = Engine.open(None, max_concurrency=flags["max_concurrency"].default,
                         max_seq_len=flags["max_seq_len"].default, verify_weights=False)
    try:
        core = engine.core.program
        program = Program(core.cfg, core.params, core.pcfg)
        prompt = list(engine.frontend.prepare(prompt=MAIN_JOB[1].split("=", 1)[1]).token_ids)
    finally:
        engine.close()
    program.wait_compiled()
    return program, prompt


def main_job_vs_program(reps: int, timeout_s: float) -> dict:
    """The main job from a cold compilation cache once, then warm, alternated with the B=1
    sampled round of a Program configured as the job's (ABAB): streamed tok/s over the
    round's tok/s."""
    program, prompt = main_job_program()
    with tempfile.TemporaryDirectory(prefix="ninfer_bench_cold_cache_") as cache:
        progress("demo: README main job, cold compilation cache")
        before = os.getloadavg()
        cold = main_job(cache, timeout_s)
        progress("demo: README main job, warm, against the Program's B=1 sampled round")
        side = MainJobSide(cache, timeout_s)
        rounds = 1 + ROUND_STEPS * (reps + 1)
        r = alternate([LocalSide("main_job", side),
                       LocalSide("program", RoundSide(program, rounds))],
                      "main_job", {"prompts": [prompt], "sampling": "sampled"},
                      reps=reps, warmup=1)
    warm = side.runs[1:]
    out = {"command": ["ninfer", *MAIN_JOB], "cold": cold, "load_before": before,
           "load_after": os.getloadavg(), "warm_runs": warm,
           "warm": {k: spread([w[k] for w in warm]) for k in
                    ("first_token_s", "last_token_s", "exit_s", "exit_after_last_s",
                     "streamed_tok_s", "tokens")},
           "ratio": r["ratios"]["main_job/program"], "load_1min": r["load_1min"],
           "program_round_tok_s": r["sides"]["program"]["rate"]}
    return out


def run_demo() -> dict:
    """Settings (environment): BENCH_ENGINE_LEVELS=1,8  BENCH_ENGINE_REPS=5
    BENCH_ENGINE_WARMUP=1  BENCH_ENGINE_STARTUP=1 (0 skips the README main job's runs)
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
        result["main_job"] = main_job_vs_program(reps, timeout_s)
    result["load_average_end"] = os.getloadavg()
    result["table"] = format_demo(result)
    print(result["table"])
    return result


# What a user should get (docs/benchmarks.md, "engine"): the Engine at the Program's speed,
# the streamed main job close to it, a prompt exit, a bounded cold start.
TARGETS = {"c1": 0.9, "c1_sampled": 0.85, "c8": 0.9, "main_job": 0.8}


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def format_demo(result: dict) -> str:
    cmp = result["comparison"]
    lines = [(f"demo model, {result['new_tokens']} new tokens per request; Engine.open "
              f"{cmp['engine_open_s']:.1f} s, second Program {cmp['program_build_s']:.1f} s"),
             (f"{'case':>11}{'Engine tok/s':>22}{'Program tok/s':>22}{'Engine/Program':>19}"
              f"{'host us/round':>20}{'us/row':>8}{'waited':>8}{'same':>6}{'load':>10}")]
    for key, r in cmp["levels"].items():
        e, p = r["sides"]["engine"]["rate"], r["sides"]["program"]["rate"]
        h, load = r["host"], r["load_1min"]
        lines.append(f"{key:>11}{fmt_spread(e):>22}{fmt_spread(p):>22}"
                     f"{fmt_spread(r['ratios']['engine/program'], 2):>19}"
                     f"{fmt_spread(h['us_per_round'], 0):>20}{h['us_per_row']['median']:>8.0f}"
                     f"{h['wait_share']['median']:>8.2f}{r['identical_tokens']!s:>6}"
                     f"{load['min']:>5.1f}-{load['max']:<4.1f}")
    for kind in ("greedy", "sampled"):
        rb = cmp[f"round_b1_{kind}"]
        lines.append(f"Program B=1 round (decode + commit), {kind}: {fmt_spread(rb['ms'], 2)} ms "
                     f"(load {rb['load_1min']['min']:.1f}-{rb['load_1min']['max']:.1f})")
    for key, r in cmp["levels"].items():
        if key in TARGETS:
            got = r["ratios"]["engine/program"]["median"]
            lines.append(f"target Engine/Program >= {TARGETS[key]} at {key}: {got:.2f} "
                         f"({_met(got >= TARGETS[key])})")
    if "main_job" in result:
        m = result["main_job"]
        cold, warm = m["cold"], m["warm"]
        lines.append(f"`{' '.join(m['command'])}` (streamed, sampled, {cold['tokens']} tokens "
                     f"cold): cold first token {cold['first_token_s']:.1f} s, last "
                     f"{cold['last_token_s']:.1f} s, exit {cold['exit_after_last_s']:.2f} s after "
                     f"it; load {m['load_before'][0]:.1f} -> {m['load_after'][0]:.1f}")
        lines.append(f"  warm: first token {fmt_spread(warm['first_token_s'], 2)} s, exit "
                     f"{fmt_spread(warm['exit_after_last_s'], 2)} s after the last, streamed "
                     f"{fmt_spread(warm['streamed_tok_s'])} tok/s; Program B=1 sampled round "
                     f"{fmt_spread(m['program_round_tok_s'])} tok/s; ratio "
                     f"{fmt_spread(m['ratio'], 2)} (load {m['load_1min']['min']:.1f}-"
                     f"{m['load_1min']['max']:.1f})")
        ratio = m["ratio"]["median"]
        lines.append(f"target streamed/Program >= {TARGETS['main_job']}: {ratio:.2f} "
                     f"({_met(ratio >= TARGETS['main_job'])}); exit <= 0.5 s after the last "
                     f"token: {warm['exit_after_last_s']['max']:.2f} s at most "
                     f"({_met(warm['exit_after_last_s']['max'] <= 0.5)}); cold first token "
                     f"<= 8 s: {cold['first_token_s']:.1f} s ({_met(cold['first_token_s'] <= 8)})"
                     f"; cold 256-token story <= 15 s: {cold['exit_s']:.1f} s "
                     f"({_met(cold['exit_s'] <= 15)})")
    return "\n".join(lines)
