"""`--suite=quant`: decode with fp32, int8 and int4 weights, each in its own process, in turns.

    python scripts/bench.py --suite=quant --out=DIR

One random fp32 checkpoint of the config (MEDIUM by default, `_checkpoint.py`) is loaded by
three long-lived workers (`workers/program_jax.py`, the Program's public API): fp32 as it is,
and int8 / int4 quantized as they load (`load_model(quantize=)`: group-wise 128, weight-only,
the bytes `ninfer convert --quantize` writes). For each decode batch B, `_abab.alternate` runs
a warm-up and REPS repetitions in turn (fp32, int8, int4, floor, fp32, ...): B random 32-token
prompts prefilled untimed, a repetition STEPS decode rounds on all B rows.

Reported per side: tok/s (median [min-max]), the weight bytes one decode step reads (values
and scales; MTP head excluded, `quant.decode_weight_bytes`), the effective read bandwidth
(tok/s x bytes / B), and the ratio to that side's bandwidth floor: the copy bandwidth measured
in the same turns (`program.CopyFloor`, numpy read + write of 1 GiB) divided by the side's
bytes per step, per round. The greedy tokens of int8/int4 are compared with fp32's (leading
tokens shared per row): quantized weights are a different model, so agreement is information,
not a check.

Settings (environment): BENCH_QUANT_CONFIG=medium|tiny  BENCH_QUANT_BATCHES=1,4
BENCH_QUANT_REPS=5  BENCH_QUANT_STEPS=16  BENCH_QUANT_METHODS=fp32,int8,int4
BENCH_TIMEOUT_S=1800.
"""

from __future__ import annotations

import os
import pathlib
import tempfile
import time

import numpy as np

from scripts.benchmarks._abab import LocalSide, Worker, alternate, fmt_spread, progress, spread
from scripts.benchmarks._checkpoint import write_random_checkpoint
from scripts.benchmarks._env import env_choices, env_int, env_ints
from scripts.benchmarks.program import CopyFloor

METHODS = ("fp32", "int8", "int4")
PROMPT_LEN = 32


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run(out_dir: str) -> dict:
    del out_dir  # bench.py writes the JSON; the table is printed
    config = os.environ.get("BENCH_QUANT_CONFIG", "medium")
    batches = env_ints("BENCH_QUANT_BATCHES", (1, 4))
    reps, steps = env_int("BENCH_QUANT_REPS", 5), env_int("BENCH_QUANT_STEPS", 16)
    timeout = env_int("BENCH_TIMEOUT_S", 1800)
    methods = env_choices("BENCH_QUANT_METHODS", METHODS, METHODS)
    start, load_start = time.perf_counter(), os.getloadavg()
    out = {"config": config, "batches": list(batches), "reps": reps, "steps": steps,
           "methods": list(methods), "setup": {}, "measurements": {}}
    with tempfile.TemporaryDirectory(prefix="ninfer_bench_quant_") as tmp:
        path = pathlib.Path(tmp) / config
        progress(f"writing a random {config} checkpoint")
        info = write_random_checkpoint(config, path)
        max_new = (reps + 2) * steps + 2
        workers = [Worker(m, "scripts.benchmarks.workers.program_jax", timeout_s=timeout,
                          setup_timeout_s=2 * timeout) for m in methods]
        try:
            for w in workers:
                progress(f"set-up {w.name}")
                su = w.setup({"path": str(path), "max_batch": max(batches),
                              "prompt_len": PROMPT_LEN, "max_new_tokens": max_new,
                              "prefill_len": PROMPT_LEN, "prefill_chunk": PROMPT_LEN,
                              "page_size": 16, "layer_loop": "auto",
                              "quantize": None if w.name == "fp32" else w.name})
                out["setup"][w.name] = {**su, "wall_s": w.setup_s}
            weight_bytes = {m: out["setup"][m]["decode_weight_bytes"] for m in methods}
            floor = CopyFloor(weight_bytes[methods[0]])
            rng = np.random.default_rng(0)
            for b in batches:
                prompts = rng.integers(0, info["vocab_size"], (b, PROMPT_LEN)).tolist()
                progress(f"decode B={b}")
                r = alternate([*workers, LocalSide("floor", floor)], f"decode_b{b}",
                              {"kind": "decode", "prompts": prompts, "steps": steps},
                              reps=reps)
                out["measurements"][f"decode_b{b}"] = _summary(r, methods, weight_bytes, b)
        finally:
            for w in workers:
                w.close()
    out.update(num_params=info["num_params"], wall_s=time.perf_counter() - start,
               load_average_start=load_start, load_average_end=os.getloadavg(),
               cpu_count=os.cpu_count())
    out["table"] = format_table(out)
    print(out["table"])
    return out


def _summary(r: dict, methods, weight_bytes: dict, b: int) -> dict:
    sides = r["sides"]
    copy = sides["floor"]["rates"]  # decode steps of the first method's bytes per second
    base = methods[0]
    rows = {}
    for m in methods:
        rates = sides[m]["rates"]
        # the side's floor per round: copy bandwidth / its own bytes per step (tok/s at B=1)
        floors = [c * weight_bytes[base] / weight_bytes[m] for c in copy]
        outputs = sides[m]["warmup_outputs"] + sides[m]["outputs"]
        rows[m] = {
            "tok_s": spread(rates), "bytes_per_step": weight_bytes[m],
            "read_gbps": spread([x / b * weight_bytes[m] / 1e9 for x in rates]),
            "steps_per_s_over_floor": spread([x / b / f for x, f in zip(rates, floors)]),
            "vs_first": spread([x / y for x, y in zip(rates, sides[base]["rates"])]),
            "tokens": [[t for o in outputs for t in o[row]] for row in range(b)]}
    ref = rows[base]["tokens"]
    for m in methods:
        rows[m]["common_prefix_with_first"] = [
            _common_prefix(x, y) for x, y in zip(rows[m]["tokens"], ref)]
        rows[m]["tokens_per_row"] = len(ref[0])
        del rows[m]["tokens"]
    bandwidth = [c * weight_bytes[base] / 1e9 for c in copy]
    return {"sides": rows, "copy_gbps": spread(bandwidth), "load_1min": r["load_1min"]}


def format_table(out: dict) -> str:
    lines = [(f"{out['config']}: {out['num_params'] / 1e6:.1f}M params; {out['reps']} reps x "
              f"{out['steps']} decode steps a side, in turns; set-up (load + compile):")]
    lines.append("  " + ", ".join(f"{m} {out['setup'][m]['wall_s']:.0f} s"
                                  for m in out["methods"]))
    for job, m in out["measurements"].items():
        lines += ["", (f"{job}: copy bandwidth {fmt_spread(m['copy_gbps'])} GB/s, 1-min load "
                       f"{m['load_1min']['min']:.1f}-{m['load_1min']['max']:.1f}"),
                  ("| weights | tok/s | vs fp32 | MB read / step | read GB/s | steps/s / floor "
                   "| greedy = fp32 (worst row) |"), "|---|---|---|---|---|---|---|"]
        for name, s in m["sides"].items():
            lines.append(
                f"| {name} | {fmt_spread(s['tok_s'])} | {fmt_spread(s['vs_first'], 2)} | "
                f"{s['bytes_per_step'] / 1e6:.1f} | {fmt_spread(s['read_gbps'], 2)} | "
                f"{fmt_spread(s['steps_per_s_over_floor'], 2)} | "
                f"{min(s['common_prefix_with_first'])}/{s['tokens_per_row']} |")
    lines.append("\nmedian [min-max] over the repetitions; vs fp32 and / floor per round; floor: "
                 "copy bandwidth (read + write) / bytes a decode step reads")
    return "\n".join(lines)
