"""Program decode and prefill next to transformers, each in its own process, taking turns.

    python scripts/bench.py --suite=program --out=DIR

For each config (tiny, then MEDIUM; random fp32 weights written once as an HF checkpoint, see
`_checkpoint.py`) two long-lived workers load the same directory: ours
(`workers/program_jax.py`: the Program's public API) and transformers
(`workers/program_hf.py`: `Qwen3_5ForCausalLM`, a manual greedy loop on its cache). Set-up
(loading, compiling) is timed and reported, never mixed into a measurement. Then, for every
measurement, `_abab.alternate` runs one warm-up repetition per side and REPS repetitions in
turn (ours, transformers, ours, ...), recording the load average around each:

- decode at B (each of BATCHES): B random 32-token prompts, admitted and prefilled untimed; a
  repetition is STEPS decode rounds on all B rows (ours: `decode` + `commit`; transformers: a
  one-token forward + argmax). Aggregate tok/s = B * STEPS / seconds. The sequences continue
  across repetitions, so the greedy tokens of both sides are compared over the whole run.
- prefill of a PREFILL_LEN random prompt to its first token (ours: staged prefill in chunks of
  PREFILL_CHUNK; transformers: one forward with a fresh cache, `logits_to_keep=1`).
- floor: a decode step must read every weight once: B=1 tok/s <= copy bandwidth / weight bytes,
  the bandwidth measured here by numpy copies of a 1 GiB buffer (bytes read + written), on one
  thread and on all cores; the faster counts.

Settings (environment): BENCH_PROGRAM_CONFIGS=tiny,medium  BENCH_PROGRAM_BATCHES=1,2,4,8
BENCH_PROGRAM_REPS=5  BENCH_PROGRAM_WARMUP=1  BENCH_PROGRAM_STEPS=16  BENCH_PROGRAM_PREFILL_LEN=512
BENCH_PROGRAM_PREFILL_CHUNK=256  BENCH_TIMEOUT_S=1800 (per worker call; set-up gets twice)
BENCH_TORCH_OMP_WAIT_POLICY=passive|active|inherit (how the transformers worker's OpenMP threads
wait; see `_env.torch_worker_env`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import tempfile
import threading
import time

import numpy as np

from scripts.benchmarks._abab import Worker, alternate, fmt_spread, progress, strip_outputs
from scripts.benchmarks._checkpoint import CONFIG_NAMES, write_random_checkpoint
from scripts.benchmarks._env import env_choices, env_int, env_ints, torch_worker_env

PROMPT_LEN = 32
PAGE_SIZE = 16
COPY_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class Settings:
    configs: tuple[str, ...] = CONFIG_NAMES
    batches: tuple[int, ...] = (1, 2, 4, 8)
    reps: int = 5
    warmup: int = 1
    steps: int = 16
    prefill_len: int = 512
    prefill_chunk: int = 256
    timeout_s: int = 1800
    torch_env: dict = dataclasses.field(default_factory=dict)  # the transformers worker's

    @classmethod
    def from_env(cls) -> Settings:
        d = cls()
        return cls(
            configs=env_choices("BENCH_PROGRAM_CONFIGS", d.configs, CONFIG_NAMES),
            batches=env_ints("BENCH_PROGRAM_BATCHES", d.batches, maximum=64),
            reps=env_int("BENCH_PROGRAM_REPS", d.reps),
            warmup=env_int("BENCH_PROGRAM_WARMUP", d.warmup, minimum=0),
            steps=env_int("BENCH_PROGRAM_STEPS", d.steps),
            prefill_len=env_int("BENCH_PROGRAM_PREFILL_LEN", d.prefill_len, minimum=2),
            prefill_chunk=env_int("BENCH_PROGRAM_PREFILL_CHUNK", d.prefill_chunk),
            timeout_s=env_int("BENCH_TIMEOUT_S", d.timeout_s), torch_env=torch_worker_env())


def copy_bandwidth(nbytes: int = COPY_BYTES, reps: int = 5) -> dict:
    """GB/s of bytes read + written by numpy copies of an nbytes buffer (median of reps), on one
    thread and split over every core."""
    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    parts = np.array_split(np.arange(len(src)), os.cpu_count() or 1)
    bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts if len(p)]

    def threaded() -> None:
        threads = [threading.Thread(target=np.copyto, args=(dst[a:b], src[a:b]))
                   for a, b in bounds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    result = {}
    for name, fn in (("one_thread_gbps", lambda: np.copyto(dst, src)),
                     ("all_cores_gbps", threaded)):
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        result[name] = 2 * nbytes / float(np.median(times)) / 1e9
    result["gbps"] = max(result["one_thread_gbps"], result["all_cores_gbps"])
    return result


def _agreement(ours: dict, hf: dict) -> dict:
    """Per row, how many leading greedy tokens the two sides share, over the whole run."""
    def rows(side: dict) -> list[list[int]]:
        out = [[t] for t in side["prepared"]]
        for rep in side["warmup_outputs"] + side["outputs"]:
            for row, tokens in zip(out, rep):
                row.extend(tokens)
        return out

    common = []
    for a, b in zip(rows(ours), rows(hf)):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        common.append(n)
    return {"tokens_per_row": len(rows(ours)[0]), "common_prefix_per_row": common}


def measure(name: str, s: Settings, bandwidth_gbps: float, workdir: pathlib.Path) -> dict:
    """Every number of one config: set-up, each measurement ABAB, floor, agreement, targets."""
    path = workdir / name
    info = write_random_checkpoint(name, path)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, info["vocab_size"], (max(s.batches), PROMPT_LEN)).tolist()
    prefill_prompt = rng.integers(0, info["vocab_size"], s.prefill_len).tolist()
    max_new = 1 + s.steps * (s.warmup + s.reps)
    jax_args = {"path": str(path), "max_batch": max(s.batches), "prompt_len": PROMPT_LEN,
                "max_new_tokens": max_new, "prefill_len": s.prefill_len,
                "prefill_chunk": s.prefill_chunk, "page_size": PAGE_SIZE}
    timeouts = {"setup_timeout_s": 2 * s.timeout_s, "timeout_s": s.timeout_s}
    out = {"config": name, **info, "setup": {}, "measurements": {}}
    with Worker("transformers", "scripts.benchmarks.workers.program_hf", env=s.torch_env,
                **timeouts) as hf, \
            Worker("ours", "scripts.benchmarks.workers.program_jax", **timeouts) as ours:
        for w, args in ((hf, {"path": str(path)}), (ours, jax_args)):  # one at a time
            progress(f"{name}: set-up of {w.name}")
            out["setup"][w.name] = {**w.setup(args), "wall_s": w.setup_s}
        out["setup"]["transformers"]["env"] = s.torch_env
        jobs = [(f"decode_b{b}", {"kind": "decode", "prompts": prompts[:b], "steps": s.steps})
                for b in s.batches]
        jobs.append((f"prefill_{s.prefill_len}", {"kind": "prefill", "prompt": prefill_prompt}))
        for job, args in jobs:
            progress(f"{name}: {job}")
            r = alternate([ours, hf], job, args, reps=s.reps, warmup=s.warmup)
            o, t = r["sides"]["ours"], r["sides"]["transformers"]
            if args["kind"] == "decode":
                r["greedy_agreement"] = _agreement(o, t)
            else:
                pairs = list(zip(o["warmup_outputs"] + o["outputs"],
                                 t["warmup_outputs"] + t["outputs"]))
                r["first_token_agreement"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
            out["measurements"][job] = strip_outputs(r)
    out["floor_b1_tokens_per_s"] = bandwidth_gbps * 1e9 / info["decode_weight_bytes"]
    if 1 in s.batches:
        rates = out["measurements"]["decode_b1"]["sides"]
        out["b1_over_floor"] = {side: rates[side]["rate"]["median"]
                                / out["floor_b1_tokens_per_s"] for side in rates}
    out["targets"] = _targets(out, s)
    return out


def _targets(out: dict, s: Settings) -> list[dict]:
    """The issue's must-hold numbers for this config (medians), met or not."""
    m, rows = out["measurements"], []
    for b in (1, max(s.batches)):
        if f"decode_b{b}" in m:
            rows.append({"what": f"decode B={b} ours/transformers", "need": 1.0,
                         "got": m[f"decode_b{b}"]["ratio"]["median"]})
    if "b1_over_floor" in out:
        rows.append({"what": "decode B=1 ours/floor", "need": 0.6,
                     "got": out["b1_over_floor"]["ours"]})
    rows.append({"what": f"prefill {s.prefill_len} ours/transformers", "need": 1.2,
                 "got": m[f"prefill_{s.prefill_len}"]["ratio"]["median"]})
    return [{**r, "met": r["got"] >= r["need"]} for r in rows]


def format_table(results: list[dict], bandwidth: dict) -> str:
    lines = [(f"copy bandwidth (read+write): one thread {bandwidth['one_thread_gbps']:.1f} "
              f"GB/s, all cores {bandwidth['all_cores_gbps']:.1f} GB/s; the floor uses "
              f"{bandwidth['gbps']:.1f}")]
    for r in results:
        su = r["setup"]
        lines += ["", (f"{r['config']}: {r['num_params'] / 1e6:.1f}M params, "
                       f"{r['decode_weight_bytes'] / 1e6:.0f} MB read per decode step, floor "
                       f"B=1 {r['floor_b1_tokens_per_s']:.1f} tok/s"),
                  (f"  set-up: ours {su['ours']['wall_s']:.1f} s (load {su['ours']['load_s']:.1f}"
                   f", compile decode {su['ours']['decode_compile_s']:.1f}, prefill "
                   f"{su['ours']['prefill_compile_s']:.1f}); transformers "
                   f"{su['transformers']['wall_s']:.1f} s ({su['transformers']['threads']} "
                   f"torch threads, {su['transformers']['env'] or 'inherited environment'})"),
                  (f"  {'measurement':<14}{'ours tok/s':>22}{'transformers tok/s':>24}"
                   f"{'ours/hf':>20}{'agree':>9}{'load 1-min':>13}")]
        for job, m in r["measurements"].items():
            o, t, q = m["sides"]["ours"], m["sides"]["transformers"], m["ratio"]
            if "greedy_agreement" in m:
                g = m["greedy_agreement"]
                agree = f"{min(g['common_prefix_per_row'])}/{g['tokens_per_row']}"
            else:
                agree = m["first_token_agreement"]
            load = m["load_1min"]
            lines.append(f"  {job:<14}{fmt_spread(o['rate']):>22}{fmt_spread(t['rate']):>24}"
                         f"{fmt_spread(q, 2):>20}{agree:>9}"
                         f"{load['min']:>6.1f}-{load['max']:<6.1f}")
        if "b1_over_floor" in r:
            f = r["b1_over_floor"]
            lines.append(f"  B=1 / floor: ours {f['ours']:.2f}, transformers "
                         f"{f['transformers']:.2f}")
        for t in r["targets"]:
            lines.append(f"  target {t['what']} >= {t['need']}: {t['got']:.2f} "
                         f"({'met' if t['met'] else 'NOT met'})")
    lines.append("\nrates: median [min-max] over the repetitions; ours/hf per ABAB pair; agree: "
                 "leading greedy tokens shared (worst row) or equal first tokens")
    return "\n".join(lines)


def run(out_dir: str) -> dict:
    del out_dir  # bench.py writes the JSON; the table is printed
    s = Settings.from_env()
    start = time.perf_counter()
    load_start = os.getloadavg()
    progress(f"settings {s}")
    bandwidth = copy_bandwidth()
    with tempfile.TemporaryDirectory(prefix="ninfer_bench_program_") as tmp:
        results = [measure(name, s, bandwidth["gbps"], pathlib.Path(tmp)) for name in s.configs]
    table = format_table(results, bandwidth)
    print(table)
    return {"settings": dataclasses.asdict(s), "bandwidth": bandwidth, "results": results,
            "load_average_start": load_start, "load_average_end": os.getloadavg(),
            "cpu_count": os.cpu_count(), "wall_s": time.perf_counter() - start, "table": table}
