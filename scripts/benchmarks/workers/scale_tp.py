"""One side of `--suite=scale`: a Program at `tensor_parallel` = tp on 4 host devices, random
weights of a config, timing B=1 decode steps and one prefill chunk; prints JSON.

    python -m scripts.benchmarks.workers.scale_tp --config=medium --tp=2 --reps=5
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()

import argparse
import json
import time

import jax
import numpy as np

from ninfer_jax.compile_cache import ensure_persistent_cache
from ninfer_jax.models.qwen3_6.weights import init_params
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.program import Program
from scripts.benchmarks._checkpoint import model_config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="medium")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--decode_tokens", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=512)
    args = ap.parse_args()
    ensure_persistent_cache()
    cfg = model_config(args.config)
    params = jax.jit(init_params, static_argnums=(0,))(cfg, jax.random.key(0))
    params = jax.tree.map(np.asarray, params)
    pcfg = ProgramConfig(max_concurrency=1, max_seq_len=1024, num_pages=80,
                         prefill_chunk=args.prefill, tensor_parallel=args.tp,
                         max_vision_patches=0)
    program = Program(cfg, params, pcfg)
    program.wait_compiled()
    prompt = np.random.default_rng(0).integers(3, cfg.vocab_size - 1, args.prefill).tolist()
    prefill, decode, tokens = [], [], None
    for rep in range(args.reps + 1):  # the first is a warm-up
        handle = program.materialize(
            program.plan_admission(len(prompt), args.decode_tokens + 1), prompt)
        start = time.perf_counter()
        while (batch := program.prefill(handle)) is None:
            pass
        program.commit(batch, [1])
        program.tokens(handle)
        mid = time.perf_counter()
        for _ in range(args.decode_tokens):
            program.commit(program.decode([handle]), [1])
        out = program.tokens(handle)[-args.decode_tokens - 1:]
        end = time.perf_counter()
        program.release(handle)
        if rep:
            prefill.append(args.prefill / (mid - start))
            decode.append(args.decode_tokens / (end - mid))
        tokens = [int(t) for t in out]
    print(json.dumps({"tp": args.tp, "prefill_tok_s": prefill, "decode_tok_s": decode,
                      "tokens": tokens, "devices": len(jax.devices())}))


if __name__ == "__main__":
    main()
