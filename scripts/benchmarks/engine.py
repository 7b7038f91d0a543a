"""Engine benchmarks.

    python scripts/bench.py --suite=engine --out=DIR   (env BENCH_ENGINE_MODEL=demo|tiny|medium)

`demo` (the default) runs `_engine_vs_program.py` on the embedded demo model: the Engine's tok/s
against its own Program's at C = 1 and 8 (one process, alternating repetitions), the Program's
B=1 round in ms, and the README main job's first token from a cold and a warm compilation cache.

`tiny` and `medium` run the two sections below on the real EngineCore over the real Program with
random weights of that config (MEDIUM: ~470M parameters, fp32) and a byte-level test tokenizer
(answers are token ids; text is irrelevant here).

- concurrency: for C in 1, 2, 4, 8, C clients each submit 2 requests in a closed loop (prompt
  128 tokens, 32 new tokens, greedy, no EOS); reports median TTFT and aggregate decode tok/s.
- multi_turn: conversations whose first turn is a long history (default 2048 tokens), then
  follow-up turns appending a short user message; run with prefix reuse on and off over the
  same prompts; reports median TTFT of follow-up turns both ways, their ratio, hit rate and
  prefill tokens saved. Outputs are checked token-identical between the two runs.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import jax
import numpy as np

from ninfer_jax.compile_cache import enable_persistent_cache
from ninfer_jax.engine import Delta, EngineCore, EngineCoreConfig
from ninfer_jax.frontend import Frontend
from ninfer_jax.models.qwen3_6.weights import init_params
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.program import Program
from ninfer_jax.sampling_params import SamplingParams
from ninfer_jax.testing.tokenizer import ByteTokenizer
from scripts.benchmarks._engine_vs_program import run_demo
from scripts.benchmarks._env import env_choice


def _config(name: str):
    from configs.models import MEDIUM
    from ninfer_jax.testing import tiny_dense

    return {"medium": MEDIUM, "tiny": tiny_dense()}[name]


def _timed(core: EngineCore, frontend: Frontend, ids: list[int], sp: SamplingParams) -> dict:
    start = time.perf_counter()
    handle = core.submit(frontend.prepare(prompt_token_ids=ids), sp)
    first = None
    for event in handle:
        if isinstance(event, Delta) and first is None:
            first = time.perf_counter()
    r = handle.result()
    end = time.perf_counter()
    return {"ttft": first - start, "total": end - start, "tokens": list(r.token_ids),
            "cached": r.usage.cached_tokens, "decode_time": end - first}


def concurrency_sweep(cfg, params, frontend, levels=(1, 2, 4, 8), prompt_len=128, new=32,
                      per_client=2) -> list[dict]:
    pcfg = ProgramConfig(max_concurrency=max(levels), page_size=16,
                         num_pages=2 * max(levels) * 16, max_seq_len=256, prefill_chunk=128,
                         num_checkpoint_slots=0)
    t0 = time.perf_counter()
    program = Program(cfg, params, pcfg)
    compile_s = time.perf_counter() - t0
    core = EngineCore(program, frontend, EngineCoreConfig(max_queue=64, prefix_reuse=False))
    rng = np.random.default_rng(0)
    sp = SamplingParams(temperature=0.0, max_new_tokens=new)
    rows = []
    try:
        _timed(core, frontend, rng.integers(300, cfg.vocab_size, prompt_len).tolist(), sp)
        for c in levels:
            results, lock = [], threading.Lock()

            def client(seed: int, results=results, lock=lock) -> None:
                local = np.random.default_rng(seed)
                for _ in range(per_client):
                    ids = local.integers(300, cfg.vocab_size, prompt_len).tolist()
                    r = _timed(core, frontend, ids, sp)
                    with lock:
                        results.append(r)

            start = time.perf_counter()
            threads = [threading.Thread(target=client, args=(100 * c + i,)) for i in range(c)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = time.perf_counter() - start
            tokens = sum(len(r["tokens"]) for r in results)
            rows.append({"concurrency": c, "requests": len(results),
                         "ttft_p50_s": statistics.median(r["ttft"] for r in results),
                         "ttft_max_s": max(r["ttft"] for r in results),
                         "aggregate_tok_s": tokens / wall, "wall_s": wall})
            print(f"  C={c}: TTFT p50 {rows[-1]['ttft_p50_s']:.2f}s max "
                  f"{rows[-1]['ttft_max_s']:.2f}s, aggregate {rows[-1]['aggregate_tok_s']:.1f} "
                  f"tok/s", flush=True)
    finally:
        core.close()
    return [{"compile_s": compile_s}] + rows


def multi_turn(cfg, params, frontend, conversations=3, turns=3, history=2048, user=32,
               new=16) -> dict:
    pcfg = ProgramConfig(max_concurrency=2, page_size=16,
                         num_pages=2 * 2 * (history + turns * (user + new) + 64) // 16,
                         max_seq_len=history + turns * (user + new) + 64, prefill_chunk=256,
                         num_checkpoint_slots=4 * conversations)
    program = Program(cfg, params, pcfg)
    rng = np.random.default_rng(1)
    sp = SamplingParams(temperature=0.0, max_new_tokens=new)
    out = {}
    for reuse in (False, True):
        core = EngineCore(program, frontend, EngineCoreConfig(prefix_reuse=reuse))
        follow, outputs = [], []
        try:
            for conv in range(conversations):
                ids = np.random.default_rng(conv).integers(300, cfg.vocab_size,
                                                           history).tolist()
                for turn in range(turns):
                    r = _timed(core, frontend, ids, sp)
                    outputs.append(r["tokens"])
                    if turn:
                        follow.append(r)
                    ids = ids + r["tokens"] + rng.integers(300, cfg.vocab_size, user).tolist()
            stats = core.stats().prefix
        finally:
            core.close()
        rng = np.random.default_rng(1)  # the same user messages for the other run
        key = "reuse" if reuse else "cold"
        out[key] = {"follow_up_ttft_p50_s": statistics.median(r["ttft"] for r in follow),
                    "follow_up_cached_tokens_p50": statistics.median(r["cached"] for r in follow),
                    "hits": stats.hits, "misses": stats.misses,
                    "prefill_tokens_saved": stats.cached_tokens}
        out[key + "_outputs"] = outputs
        print(f"  {key}: follow-up TTFT p50 {out[key]['follow_up_ttft_p50_s']:.2f}s, "
              f"cached p50 {out[key]['follow_up_cached_tokens_p50']}", flush=True)
    out["identical_outputs"] = out.pop("cold_outputs") == out.pop("reuse_outputs")
    out["ttft_ratio_reuse_over_cold"] = (out["reuse"]["follow_up_ttft_p50_s"]
                                         / out["cold"]["follow_up_ttft_p50_s"])
    return out


def run(out_dir: str) -> dict:
    enable_persistent_cache()
    name = env_choice("BENCH_ENGINE_MODEL", "demo", ("demo", "tiny", "medium"))
    if name == "demo":
        return run_demo()
    cfg = _config(name)
    params = init_params(cfg, jax.random.key(0))
    frontend = Frontend(ByteTokenizer(vocab_size=cfg.vocab_size))
    print(f"engine benchmark on {name} (load average {os.getloadavg()})", flush=True)
    result = {"model": name, "load_average": os.getloadavg()}
    result["concurrency"] = concurrency_sweep(cfg, params, frontend)
    small = name == "tiny"
    result["multi_turn"] = multi_turn(cfg, params, frontend,
                                      history=256 if small else 2048)
    print("\nconcurrency  TTFT p50 (s)  aggregate tok/s")
    for row in result["concurrency"][1:]:
        print(f"{row['concurrency']:>11}  {row['ttft_p50_s']:>12.2f}  {row['aggregate_tok_s']:>15.1f}")
    mt = result["multi_turn"]
    print(f"\nmulti-turn follow-up TTFT: cold {mt['cold']['follow_up_ttft_p50_s']:.2f}s, "
          f"reuse {mt['reuse']['follow_up_ttft_p50_s']:.2f}s, ratio "
          f"{mt['ttft_ratio_reuse_over_cold']:.3f}; hits {mt['reuse']['hits']}/"
          f"{mt['reuse']['hits'] + mt['reuse']['misses']}, prefill tokens saved "
          f"{mt['reuse']['prefill_tokens_saved']}, identical outputs {mt['identical_outputs']}")
    return result
