"""Scoring throughput: CausalScoreCore next to transformers, each in its own process, in turns.

    python scripts/bench.py --suite=scoring --out=DIR

For each config (tiny, then MEDIUM; random fp32 weights written once as an HF checkpoint, see
`_checkpoint.py`) two long-lived workers load the same directory: ours
(`workers/scoring_jax.py`: `CausalScoreCore`, one compiled window shape) and transformers
(`workers/scoring_hf.py`: forward + `log_softmax` + gather + argmax, as lm-evaluation-harness's
HF backend scores). The job: WINDOWS random sequences of WINDOW + 1 tokens, each one window
scoring WINDOW targets, ROWS windows per call. Set-up is timed and reported apart; then one
warm-up repetition per side and REPS repetitions in turn (ours, transformers, ...), with the
load average around each. Scored tokens/s = targets / seconds. Both sides' log-probs are
compared (max error relative to the largest |log-prob|) and their greedy flags counted.

Settings (environment): BENCH_SCORING_CONFIGS=tiny,medium  BENCH_SCORING_WINDOWS (default 16
on tiny, 4 on MEDIUM)  BENCH_SCORING_WINDOW=256  BENCH_SCORING_ROWS=2  BENCH_SCORING_REPS=5
BENCH_SCORING_WARMUP=1  BENCH_TIMEOUT_S=1800  BENCH_TORCH_OMP_WAIT_POLICY (see `_env.py`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tempfile
import time

import numpy as np

from scripts.benchmarks._abab import Worker, alternate, fmt_spread, progress, strip_outputs
from scripts.benchmarks._checkpoint import CONFIG_NAMES, write_random_checkpoint
from scripts.benchmarks._env import env_choices, env_int, torch_worker_env

DEFAULT_WINDOWS = {"tiny": 16, "medium": 4}


@dataclasses.dataclass(frozen=True)
class Settings:
    configs: tuple[str, ...] = CONFIG_NAMES
    windows: int | None = None  # None: DEFAULT_WINDOWS per config
    window: int = 256
    rows: int = 2
    reps: int = 5
    warmup: int = 1
    timeout_s: int = 1800
    torch_env: dict = dataclasses.field(default_factory=dict)  # the transformers worker's

    @classmethod
    def from_env(cls) -> Settings:
        d = cls()
        windows = env_int("BENCH_SCORING_WINDOWS", 0, minimum=1)
        return cls(configs=env_choices("BENCH_SCORING_CONFIGS", d.configs, CONFIG_NAMES),
                   windows=windows or None,
                   window=env_int("BENCH_SCORING_WINDOW", d.window, minimum=2),
                   rows=env_int("BENCH_SCORING_ROWS", d.rows),
                   reps=env_int("BENCH_SCORING_REPS", d.reps),
                   warmup=env_int("BENCH_SCORING_WARMUP", d.warmup, minimum=0),
                   timeout_s=env_int("BENCH_TIMEOUT_S", d.timeout_s),
                   torch_env=torch_worker_env())


def measure(name: str, s: Settings, workdir: pathlib.Path) -> dict:
    path = workdir / name
    info = write_random_checkpoint(name, path)
    num_windows = s.windows or DEFAULT_WINDOWS[name]
    rng = np.random.default_rng(0)
    seqs = rng.integers(0, info["vocab_size"], (num_windows, s.window + 1)).tolist()
    timeouts = {"setup_timeout_s": 2 * s.timeout_s, "timeout_s": s.timeout_s}
    out = {"config": name, **info, "window": s.window, "num_windows": num_windows,
           "rows_per_call": s.rows, "setup": {}}
    with Worker("transformers", "scripts.benchmarks.workers.scoring_hf", env=s.torch_env,
                **timeouts) as hf, \
            Worker("ours", "scripts.benchmarks.workers.scoring_jax", **timeouts) as ours:
        for w, args in ((hf, {"path": str(path), "rows": s.rows}),
                        (ours, {"path": str(path), "window": s.window, "rows": s.rows})):
            progress(f"{name}: set-up of {w.name}")
            out["setup"][w.name] = {**w.setup(args), "wall_s": w.setup_s}
        out["setup"]["transformers"]["env"] = s.torch_env
        progress(f"{name}: scoring {num_windows} x {s.window}")
        r = alternate([ours, hf], "score", {"seqs": seqs}, reps=s.reps, warmup=s.warmup)
    o, t = (r["sides"][n]["outputs"][-1] for n in ("ours", "transformers"))
    lo, lt = np.array(o["logprobs"]), np.array(t["logprobs"])
    out["logprob_rel_err"] = float(np.abs(lo - lt).max() / np.abs(lt).max())
    out["greedy_flags_agree"] = float((np.array(o["is_greedy"]) == np.array(t["is_greedy"]))
                                      .mean())
    out["measurement"] = strip_outputs(r)
    return out


def format_table(results: list[dict]) -> str:
    lines = [(f"{'config':<8}{'params':>9}{'windows':>16}{'ours tok/s':>26}"
              f"{'transformers tok/s':>24}{'ours/hf':>20}{'rel err':>9}{'greedy':>8}"
              f"{'load 1-min':>12}")]
    for r in results:
        m = r["measurement"]
        windows = f"{r['num_windows']}x{r['window']} B={r['rows_per_call']}"
        load = m["load_1min"]
        lines.append(
            f"{r['config']:<8}{r['num_params'] / 1e6:>8.1f}M{windows:>16}"
            f"{fmt_spread(m['sides']['ours']['rate']):>26}"
            f"{fmt_spread(m['sides']['transformers']['rate']):>24}"
            f"{fmt_spread(m['ratios']['ours/transformers'], 2):>20}{r['logprob_rel_err']:>9.1e}"
            f"{r['greedy_flags_agree']:>8.1%}{load['min']:>6.1f}-{load['max']:<5.1f}")
    for r in results:
        su = r["setup"]
        lines.append(f"{r['config']} set-up: ours {su['ours']['wall_s']:.1f} s (compile "
                     f"{su['ours']['compile_s']:.1f}), transformers {su['transformers']['wall_s']:.1f}"
                     f" s ({su['transformers']['threads']} torch threads, "
                     f"{su['transformers']['env'] or 'inherited environment'})")
    lines.append("tok/s: scored tokens, median [min-max] over the repetitions; ours/hf per ABAB "
                 "pair")
    return "\n".join(lines)


def run(out_dir: str) -> dict:
    del out_dir  # bench.py writes the JSON; the table is printed
    s = Settings.from_env()
    start = time.perf_counter()
    progress(f"settings {s}")
    with tempfile.TemporaryDirectory(prefix="ninfer_bench_scoring_") as tmp:
        results = [measure(name, s, pathlib.Path(tmp)) for name in s.configs]
    table = format_table(results)
    print(table)
    return {"settings": dataclasses.asdict(s), "results": results, "cpu_count": os.cpu_count(),
            "wall_s": time.perf_counter() - start, "table": table}
