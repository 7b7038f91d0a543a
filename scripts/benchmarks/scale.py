"""`--suite=scale`: tensor parallel on CPU host devices, and scoring across processes.

1. tp = 1, 2, 4 at MEDIUM (random weights): each size a fresh process with 4 host devices
   (`workers/scale_tp.py`), in turns (1, 2, 4, 1, 2, 4, ...: BENCH_SCALE_TURNS turns), each
   timing one 512-token prefill chunk and 16 B=1 decode steps BENCH_SCALE_REPS times after a
   warm-up; greedy tokens must equal tp = 1's. On one shared 2-core machine the split only adds
   collectives (the host devices share the same cores): a report, not a target.
2. 1 vs 2 scoring processes on the demo model (`scoring_procs.run`): byte-identical outputs.
Medians, min-max, and the load average around each turn.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

from scripts.benchmarks import scoring_procs
from scripts.benchmarks._env import env_int, env_ints

REPO = scoring_procs.REPO


def _turn(config: str, tp: int, reps: int) -> dict:
    done = subprocess.run([sys.executable, "-m", "scripts.benchmarks.workers.scale_tp",
                           f"--config={config}", f"--tp={tp}", f"--reps={reps}"], cwd=REPO,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"tp={tp} worker failed: {done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _summary(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def run(out_dir) -> dict:
    config = os.environ.get("BENCH_SCALE_CONFIG", "medium")
    sizes = env_ints("BENCH_SCALE_TP", (1, 2, 4))
    turns, reps = env_int("BENCH_SCALE_TURNS", 2), env_int("BENCH_SCALE_REPS", 3)
    sides: dict[int, dict] = {tp: {"prefill": [], "decode": [], "load": []} for tp in sizes}
    tokens = {}
    for _ in range(turns):
        for tp in sizes:
            before = os.getloadavg()[0]
            r = _turn(config, tp, reps)
            sides[tp]["prefill"] += r["prefill_tok_s"]
            sides[tp]["decode"] += r["decode_tok_s"]
            sides[tp]["load"] += [before, os.getloadavg()[0]]
            tokens[tp] = r["tokens"]
    same = all(tokens[tp] == tokens[sizes[0]] for tp in sizes)
    lines = [f"config {config}, {turns} turns x {reps} reps a side; greedy tokens equal: {same}",
             "| tp | prefill tok/s | decode B=1 tok/s | decode / tp=1 | 1-min load |",
             "|---|---|---|---|---|"]
    base = statistics.median(sides[sizes[0]]["decode"])
    for tp in sizes:
        s = sides[tp]
        lines.append(f"| {tp} | {_summary(s['prefill'])} | {_summary(s['decode'])} | "
                     f"{statistics.median(s['decode']) / base:.2f} | "
                     f"{min(s['load']):.1f}-{max(s['load']):.1f} |")
    procs = scoring_procs.run(out_dir, records=env_int("BENCH_SCALE_RECORDS", 200),
                              reps=env_int("BENCH_SCALE_SCORE_REPS", 2))
    table = "\n".join(lines) + "\n\n" + procs.get("table", "")
    print(table)
    if not same:
        raise AssertionError(f"greedy tokens differ across tp: {tokens}")
    return {"tp": {str(k): v for k, v in sides.items()}, "tokens_equal": same,
            "scoring_processes": procs, "table": table}
