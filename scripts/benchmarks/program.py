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
- floor: a decode step must read every weight once: B=1 tok/s <= copy bandwidth / weight bytes.
  The bandwidth is measured in turn with the engines, as a third side of decode B=1 (`CopyFloor`,
  in this process): numpy copies of a 1 GiB buffer, bytes read + written, on one thread and
  split over every core, the faster counting; so ours/floor is a per-round ratio too.
- GEMV chain: a fourth side of decode B=1 (`workers/gemv_jax.py`, its own process) multiplies a
  vector by every weight matrix the decode step reads, one jitted chain of XLA dots and nothing
  else: ours/gemv is how close the decode step is to XLA:CPU's own matrix-vector speed on the
  same weights, per round.

Settings (environment): BENCH_PROGRAM_CONFIGS=tiny,medium  BENCH_PROGRAM_BATCHES=1,2,4,8
BENCH_PROGRAM_REPS=5  BENCH_PROGRAM_WARMUP=1  BENCH_PROGRAM_STEPS=16  BENCH_PROGRAM_PREFILL_LEN=512
BENCH_PROGRAM_PREFILL_CHUNK=256  BENCH_PROGRAM_LAYER_LOOP=auto|unrolled|scan
BENCH_TIMEOUT_S=1800 (per worker call; set-up gets twice)
BENCH_TORCH_OMP_WAIT_POLICY=passive|active|inherit (how the transformers worker's OpenMP threads
wait; see `_env.torch_worker_env`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import tempfile
import threading
import time

import numpy as np

from ninfer_jax.program.config import LAYER_LOOPS
from scripts.benchmarks._abab import (
    LocalSide,
    Worker,
    alternate,
    fmt_spread,
    progress,
    spread,
    strip_outputs,
)
from scripts.benchmarks._checkpoint import CONFIG_NAMES, write_random_checkpoint
from scripts.benchmarks._env import env_choice, env_choices, env_int, env_ints, torch_worker_env

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
    layer_loop: str = "auto"
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
            layer_loop=env_choice("BENCH_PROGRAM_LAYER_LOOP", d.layer_loop, LAYER_LOOPS),
            timeout_s=env_int("BENCH_TIMEOUT_S", d.timeout_s), torch_env=torch_worker_env())


class CopyFloor:
    """The bandwidth floor as an in-process side of `alternate`. A repetition copies a
    COPY_BYTES buffer with numpy on one thread and split over every core, and keeps the faster;
    its work is the bytes moved (read + written) counted in decode steps' worth of weight reads,
    so its rate is the B=1 floor in tok/s."""

    def __init__(self, weight_bytes: int):
        self.weight_bytes = weight_bytes

    def prepare(self, name: str, args: dict) -> None:
        self.src = np.ones(COPY_BYTES // 4, np.float32)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)
        parts = np.array_split(np.arange(len(self.src)), os.cpu_count() or 1)
        self.bounds = [(int(p[0]), int(p[-1]) + 1) for p in parts if len(p)]

    def _threaded(self) -> None:
        threads = [threading.Thread(target=np.copyto, args=(self.dst[a:b], self.src[a:b]))
                   for a, b in self.bounds]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def rep(self, name: str) -> dict:
        seconds = {}
        for key, fn in (("one_thread", lambda: np.copyto(self.dst, self.src)),
                        ("all_cores", self._threaded)):
            start = time.perf_counter()
            fn()
            seconds[key] = time.perf_counter() - start
        moved = 2 * COPY_BYTES
        return {"seconds": min(seconds.values()), "work": moved / self.weight_bytes,
                "outputs": {f"{k}_gbps": moved / v / 1e9 for k, v in seconds.items()}}

    def finish(self, name: str) -> None:
        self.src = self.dst = None


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


def measure(name: str, s: Settings, workdir: pathlib.Path) -> dict:
    """Every number of one config: set-up, each measurement ABAB, floor, agreement, targets."""
    path = workdir / name
    info = write_random_checkpoint(name, path)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, info["vocab_size"], (max(s.batches), PROMPT_LEN)).tolist()
    prefill_prompt = rng.integers(0, info["vocab_size"], s.prefill_len).tolist()
    max_new = 1 + s.steps * (s.warmup + s.reps)
    jax_args = {"path": str(path), "max_batch": max(s.batches), "prompt_len": PROMPT_LEN,
                "max_new_tokens": max_new, "prefill_len": s.prefill_len,
                "prefill_chunk": s.prefill_chunk, "page_size": PAGE_SIZE,
                "layer_loop": s.layer_loop}
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
            with contextlib.ExitStack() as extra:
                sides = [ours, hf]
                if job == "decode_b1":
                    sides.append(LocalSide("floor", CopyFloor(info["decode_weight_bytes"])))
                    gemv = extra.enter_context(Worker(
                        "gemv", "scripts.benchmarks.workers.gemv_jax", **timeouts))
                    progress(f"{name}: set-up of gemv")
                    out["setup"]["gemv"] = {**gemv.setup({"path": str(path)}),
                                            "wall_s": gemv.setup_s}
                    sides.append(gemv)
                r = alternate(sides, job, args, reps=s.reps, warmup=s.warmup)
            o, t = r["sides"]["ours"], r["sides"]["transformers"]
            if args["kind"] == "decode":
                r["greedy_agreement"] = _agreement(o, t)
            else:
                pairs = list(zip(o["warmup_outputs"] + o["outputs"],
                                 t["warmup_outputs"] + t["outputs"]))
                r["first_token_agreement"] = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
            out["measurements"][job] = strip_outputs(r)
            if job == "decode_b1":
                out["floor_b1"] = _floor(r)
    out["targets"] = _targets(out, s)
    return out


def _floor(r: dict) -> dict:
    """The floor side of decode B=1: its tok/s, the bandwidths, each engine's per-round ratio."""
    floor = r["sides"]["floor"]
    copies = floor["warmup_outputs"] + floor["outputs"]
    hf = [x / y for x, y in zip(r["sides"]["transformers"]["rates"], floor["rates"])]
    return {"tokens_per_s": floor["rate"], "ours/floor": r["ratios"]["ours/floor"],
            "transformers/floor": spread(hf), "ours/gemv": r["ratios"].get("ours/gemv"),
            "gemv_steps_per_s": r["sides"]["gemv"]["rate"] if "gemv" in r["sides"] else None,
            **{f"{k}_gbps": spread([c[f"{k}_gbps"] for c in copies])
               for k in ("one_thread", "all_cores")}}


def _targets(out: dict, s: Settings) -> list[dict]:
    """The issue's must-hold numbers for this config (medians), met or not."""
    m, rows = out["measurements"], []
    for b in sorted({1, max(s.batches)}):
        if f"decode_b{b}" in m:
            rows.append({"what": f"decode B={b} ours/transformers", "need": 1.0,
                         "got": m[f"decode_b{b}"]["ratios"]["ours/transformers"]["median"]})
    if "floor_b1" in out:
        rows.append({"what": "decode B=1 ours/floor", "need": 0.6,
                     "got": out["floor_b1"]["ours/floor"]["median"]})
    rows.append({"what": f"prefill {s.prefill_len} ours/transformers", "need": 1.2,
                 "got": m[f"prefill_{s.prefill_len}"]["ratios"]["ours/transformers"]["median"]})
    return [{**r, "met": r["got"] >= r["need"]} for r in rows]


def format_table(results: list[dict]) -> str:
    lines = []
    for r in results:
        su = r["setup"]
        lines += ["", (f"{r['config']}: {r['num_params'] / 1e6:.1f}M params, "
                       f"{r['decode_weight_bytes'] / 1e6:.0f} MB read per decode step"),
                  (f"  set-up: ours {su['ours']['wall_s']:.1f} s (load {su['ours']['load_s']:.1f}"
                   f", compile decode {su['ours']['decode_compile_s']:.1f}, prefill "
                   f"{su['ours']['prefill_compile_s']:.1f}); transformers "
                   f"{su['transformers']['wall_s']:.1f} s ({su['transformers']['threads']} "
                   f"torch threads, {su['transformers']['env'] or 'inherited environment'})"),
                  (f"  {'measurement':<14}{'ours tok/s':>24}{'transformers tok/s':>26}"
                   f"{'ours/hf':>20}{'agree':>9}{'load 1-min':>13}")]
        for job, m in r["measurements"].items():
            o, t = m["sides"]["ours"], m["sides"]["transformers"]
            q = m["ratios"]["ours/transformers"]
            if "greedy_agreement" in m:
                g = m["greedy_agreement"]
                agree = f"{min(g['common_prefix_per_row'])}/{g['tokens_per_row']}"
            else:
                agree = m["first_token_agreement"]
            load = m["load_1min"]
            lines.append(f"  {job:<14}{fmt_spread(o['rate']):>24}{fmt_spread(t['rate']):>26}"
                         f"{fmt_spread(q, 2):>20}{agree:>9}"
                         f"{load['min']:>6.1f}-{load['max']:<6.1f}")
        if "floor_b1" in r:
            f = r["floor_b1"]
            lines += [(f"  floor B=1 {fmt_spread(f['tokens_per_s'])} tok/s (copy read+write, "
                       f"GB/s: one thread {fmt_spread(f['one_thread_gbps'])}, all cores "
                       f"{fmt_spread(f['all_cores_gbps'])})"),
                      (f"  B=1 / floor per round: ours {fmt_spread(f['ours/floor'], 2)}, "
                       f"transformers {fmt_spread(f['transformers/floor'], 2)}")]
            if f.get("ours/gemv"):
                gb = r["setup"]["gemv"]["matrix_bytes"] / 1e9
                g = f["gemv_steps_per_s"]
                lines.append(f"  B=1 / XLA GEMV chain over the same weights per round: ours "
                             f"{fmt_spread(f['ours/gemv'], 2)} (chain {fmt_spread(g)} steps/s, "
                             f"{g['median'] * gb:.1f} GB/s read)")
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
    with tempfile.TemporaryDirectory(prefix="ninfer_bench_program_") as tmp:
        results = [measure(name, s, pathlib.Path(tmp)) for name in s.configs]
    table = format_table(results)
    print(table)
    return {"settings": dataclasses.asdict(s), "results": results,
            "load_average_start": load_start, "load_average_end": os.getloadavg(),
            "cpu_count": os.cpu_count(), "wall_s": time.perf_counter() - start, "table": table}
