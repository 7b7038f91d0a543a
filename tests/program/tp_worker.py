"""Runs one fixture model through the Engine at several tensor-parallel sizes in one process
with 4 host devices, and prints what `test_tensor_parallel.py` checks, as JSON.

`python -m tests.program.tp_worker --model=dense --tp=1,2,4 [--loop=scan] [--impl=pallas]
[--moe_sharding=expert] [--kv_dtype=int8]`. The model is a transformers fixture (`tests/fixtures/<model>`) with a
seeded random MTP head added, so MTP speculation is on; prefix reuse is on (a multi-turn session
restores a checkpoint). For each size: the greedy tokens and log-probs of every request through
an EngineCore, the share of each weight and pool one device holds (from the arrays' shardings),
the full-sequence logits of the placed weights, the executables compiled before and after the
requests, and the Engine's prefix hits.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4").strip()

import argparse
import dataclasses
import json
import pathlib
import warnings

import jax
import numpy as np

from ninfer_jax import quant
from ninfer_jax.compile_cache import enable_persistent_cache
from ninfer_jax.engine import EngineCore, EngineCoreConfig
from ninfer_jax.frontend import Frontend
from ninfer_jax.loader import load_model
from ninfer_jax.models.qwen3_6 import forward
from ninfer_jax.models.qwen3_6.weights import init_params
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.program import Program
from ninfer_jax.program.sharding import sharded_fraction
from ninfer_jax.sampling_params import SamplingParams
from ninfer_jax.testing.tokenizer import ByteTokenizer

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "fixtures"


def _model(name: str):
    loaded = load_model(FIXTURES / name)
    cfg = dataclasses.replace(loaded.config, mtp_num_layers=1)
    mtp = init_params(cfg, jax.random.key(7), num_mtp_layers=1)["mtp"]
    params = {**jax.tree.map(np.asarray, loaded.params), "mtp": jax.tree.map(np.asarray, mtp)}
    return cfg, params


def _fractions(tree) -> dict[str, float]:
    return {jax.tree_util.keystr(path): sharded_fraction(a)
            for path, a in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _requests(core: EngineCore, tokenizer, prompts) -> list[dict]:
    frontend = Frontend(tokenizer)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, stop=(), logprobs=4)
    out = []
    history = prompts[0]
    for turn in range(2):  # a multi-turn session: the second turn restores a checkpoint
        r = core.submit(frontend.prepare(prompt_token_ids=history), greedy,
                        session_key="session").result(timeout=300)
        out.append(r)
        history = history + list(r.token_ids) + [11, 12, 13]
    handles = [core.submit(frontend.prepare(prompt_token_ids=p), greedy) for p in prompts[1:]]
    out += [h.result(timeout=300) for h in handles]  # decoded together (B = 2)
    return [{"tokens": list(r.token_ids),
             "logprobs": [x.logprob for x in r.logprobs],
             "top": [[[t, lp] for t, lp in x.top] for x in r.logprobs]} for r in out]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dense")
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--loop", default="auto")
    ap.add_argument("--impl", default="reference")
    ap.add_argument("--moe_sharding", default="intermediate")
    ap.add_argument("--kv_dtype", default="auto")
    ap.add_argument("--quantize", default=None)
    args = ap.parse_args()
    enable_persistent_cache()  # $NINFER_JAX_CACHE_DIR: the test run's cache
    warnings.filterwarnings("error", message="Some donated buffers were not usable")
    cfg, params = _model(args.model)
    if args.quantize:
        params = quant.quantize_params(params, args.quantize)
    tokenizer = ByteTokenizer(vocab_size=cfg.vocab_size)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, size=n).tolist() for n in (21, 5, 37)]
    ids = np.asarray([prompts[2]], np.int32)
    logits_fn = jax.jit(forward, static_argnums=1)
    report = {"devices": len(jax.devices()), "runs": {}}
    for tp in map(int, args.tp.split(",")):
        pcfg = ProgramConfig(max_concurrency=2, num_pages=48, max_seq_len=128, prefill_chunk=16,
                             num_checkpoint_slots=6, speculative="mtp",
                             num_speculative_tokens=2, layer_loop=args.loop,
                             attention_impl=args.impl, gdn_impl=args.impl, tensor_parallel=tp,
                             moe_sharding=args.moe_sharding, max_vision_patches=0,
                             kv_dtype=args.kv_dtype)
        program = Program(cfg, params, pcfg)
        program.wait_compiled()
        before = sorted(map(str, program.executables.keys()))
        compiled = len(program.executables.compile_seconds)
        core = EngineCore(program, Frontend(tokenizer), EngineCoreConfig())
        try:
            results = _requests(core, tokenizer, prompts)
            prefix = core.stats().prefix
        finally:
            core.close()
        logits = np.asarray(logits_fn(program.params, cfg, ids))
        report["runs"][tp] = {
            "results": results, "prefix_hits": prefix.hits,
            "params": _fractions(program.params), "pools": _fractions(program.pools),
            "per_device_bytes": sum(a.addressable_shards[0].data.nbytes
                                    for a in jax.tree.leaves(program.params)),
            "total_bytes": sum(a.nbytes for a in jax.tree.leaves(program.params)),
            "logits": logits.tolist(),
            "recompiled": (sorted(map(str, program.executables.keys())) != before
                           or len(program.executables.compile_seconds) != compiled),
        }
        program.close()
    print(json.dumps(report))


if __name__ == "__main__":
    main()
