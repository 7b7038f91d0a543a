"""Run by `test_cuda_compile.py` with the python of a venv that has jax's CUDA plugin: compiles
for sm_90 (compile-only H200 devices) and prints one JSON object.

    python tests/program/cuda_compile_worker.py programs | kernels | scoring
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

import dataclasses
import itertools
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from jax.sharding import SingleDeviceSharding

from ninfer_jax.program import hlo
from ninfer_jax.program.aot import compile_all, gpu_devices
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.testing import tiny_dense, tiny_moe
from ninfer_jax.testing.configs import tiny_drafter


def programs() -> dict:
    """A tiny dense and a tiny MoE Program (MTP K = 2 on the dense one, its rounds of 0 and 1
    drafts too (key "decode[B][K]"), the lean rounds of 0 ("decode[B][0][2]") and the bare
    ones ("decode[B][0][1]"), INT8 pages
    on the MoE
    one; the MoE one with either layer loop: per-layer weights, the GPU's default, and a scan
    handing kernels their stacked weights), and a dense one with a DFlash drafter (K = 4: its
    rounds of 0, 1 and 4 and the bare rounds of 0, "decode[B][0][1]"), every executable
    compiled: ok, Triton kernels, expert-by-token tensors."""
    out = {}
    base = ProgramConfig(max_concurrency=2, max_seq_len=128, num_pages=32, page_size=16,
                         prefill_chunk=32, dtype="bfloat16", attention_impl="pallas",
                         gdn_impl="pallas", layer_loop="unrolled", num_checkpoint_slots=2)
    moe = dataclasses.replace(base, kv_dtype="int8")
    cases = {"dense": (tiny_dense(mtp_num_layers=1), dataclasses.replace(
                 base, speculative="mtp", num_speculative_tokens=2)),
             "moe": (tiny_moe(), moe),
             "moe scan": (tiny_moe(), dataclasses.replace(moe, layer_loop="scan")),
             "dflash": (tiny_dense(), dataclasses.replace(
                 base, speculative="dflash", num_speculative_tokens=4))}
    for name, (cfg, pcfg) in cases.items():
        def inspect(key, text, cfg=cfg):
            module = hlo.parse(text)
            found = hlo.expert_by_token(module, cfg.num_experts or 0,
                                        {1, 2, 3, 4, 6, 32, 64}) if cfg.num_experts else []
            return {"kernels": hlo.triton_kernels(module), "expert_by_token": found}

        drafter = tiny_drafter(cfg) if pcfg.speculative == "dflash" else None
        results = compile_all(cfg, pcfg, gpu_devices("h200"), inspect=inspect, drafter=drafter)
        out[name] = [{"key": f"{r.key.kind.value}[{r.key.batch}]"
                      + "".join(f"[{x}]" for x in r.key.extra), "ok": r.ok,
                      "error": r.error[:300], "temp_bytes": r.temp_bytes,
                      **(r.findings or {})} for r in results]
    return out


def kernels() -> dict:
    """The paged attention kernels (decode and prefill, float and INT8 pages) across fp32 and
    bf16, head_dim 64..256, GQA groups 1..8 and page sizes 16..128, and the grouped matmul with
    float and quantized experts: compiled for sm_90 with the block sizes the kernels pick."""
    from ninfer_jax import quant
    from pallas_kernels.grouped_matmul import grouped_matmul
    from pallas_kernels.paged_attention import (
        PagedAttentionInputs,
        paged_attention_decode,
        paged_attention_prefill,
    )

    device = SingleDeviceSharding(gpu_devices("h200")[0])

    def spec(shape, dtype):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=device)

    def compiles(fn, *args) -> str:
        try:
            jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compile()
            return "ok"
        except Exception as e:  # noqa: BLE001 - the failure is the result
            m = re.search(r"Shared memory size limit exceeded[^\n]*", str(e))
            return m.group(0) if m else str(e).splitlines()[0][:200]

    out = {}
    grid = itertools.product(("float32", "bfloat16"), (64, 128, 256), (1, 8), (16, 128))
    for dtype, head_dim, group, page in grid:
        kv, b, t, pages, width = 2, 2, 32, 40, 16
        dt = jnp.dtype(dtype)
        k_pages = spec((pages, page, kv, head_dim), dt)
        table, lens = spec((b, width), jnp.int32), spec((b,), jnp.int32)
        q1 = spec((b, group * kv, head_dim), dt)
        qt = spec((b, t, group * kv, head_dim), dt)
        chunk = spec((b, t, kv, head_dim), dt)
        tag = f"{dtype} D={head_dim} G={group} page={page}"
        pages = PagedAttentionInputs(k_pages, k_pages, table, lens)
        chunks = PagedAttentionInputs(k_pages, k_pages, table, lens, chunk_k=chunk,
                                      chunk_v=chunk, chunk_lens=lens)
        out[f"decode {tag}"] = compiles(
            lambda *a: paged_attention_decode(*a, impl="pallas"), q1, pages)
        out[f"prefill {tag}"] = compiles(
            lambda *a: paged_attention_prefill(*a, impl="pallas"), qt, chunks)
    int8 = spec((40, 128, 2, 256), jnp.int8)
    scales = spec((40, 128, 2), jnp.float32)
    for dtype in ("float32", "bfloat16"):
        dt = jnp.dtype(dtype)
        out[f"decode int8 pages {dtype} D=256 G=8 page=128"] = compiles(
            lambda *a: paged_attention_decode(*a, impl="pallas"), spec((2, 16, 256), dt),
            PagedAttentionInputs(int8, int8, spec((2, 16), jnp.int32), spec((2,), jnp.int32),
                                 scales, scales))
        # skip_empty (the MTP head's attention): both kernels, the largest tiles
        pool, lens = spec((40, 128, 2, 256), dt), spec((2,), jnp.int32)
        chunk = spec((2, 32, 2, 256), dt)
        out[f"decode skip_empty {dtype} D=256 G=8 page=128"] = compiles(
            lambda *a: paged_attention_decode(*a, impl="pallas"), spec((2, 16, 256), dt),
            PagedAttentionInputs(pool, pool, spec((2, 16), jnp.int32), lens, skip_empty=True))
        out[f"prefill skip_empty {dtype} D=256 G=8 page=128"] = compiles(
            lambda *a: paged_attention_prefill(*a, impl="pallas"), spec((2, 32, 16, 256), dt),
            PagedAttentionInputs(pool, pool, spec((2, 16), jnp.int32), lens, chunk_k=chunk,
                                 chunk_v=chunk, chunk_lens=lens, skip_empty=True))
    e, n, k = 16, 128, 256
    for method in (None, "int8", "int4", "fp8"):
        w = jnp.zeros((2, e, n, k), jnp.float32)
        if method is not None:
            w = quant.fp8_blocks(w) if method == "fp8" else quant.quantize_int(w, method)
        w = jax.tree.map(lambda a: spec(a.shape, a.dtype), w)
        for rows in (4, 512):
            out[f"grouped {method or 'bf16'} rows={rows}"] = compiles(
                lambda x, w, ids, sizes, layer: grouped_matmul(x, w, sizes, w_up=w,
                                                               row_ids=ids, layer=layer),
                spec((rows // 2, k), jnp.bfloat16), w, spec((rows,), jnp.int32),
                spec((e,), jnp.int32), spec((1,), jnp.int32))
    return out


def scoring() -> dict:
    """The CausalScoring executables (a packed window call and a shared-context call) of the
    tiny dense and MoE models in fp32 and bf16, over per-layer weights as a ScoringProgram
    holds them on a GPU (an unrolled layer loop): compiled for sm_90, with the temporary bytes
    and any expert-by-token tensor in the compiled HLO."""
    from ninfer_jax.models.qwen3_6.model import unstack_layers
    from ninfer_jax.models.qwen3_6.weights import init_params
    from ninfer_jax.program.executables import bind
    from ninfer_jax.program.scoring import SharedKey, WindowKey, _example
    from ninfer_jax.program.scoring_steps import score_shared_step, score_window_step

    device = SingleDeviceSharding(gpu_devices("h200")[0])
    out = {}
    for (name, cfg), dtype in itertools.product((("dense", tiny_dense()), ("moe", tiny_moe())),
                                                ("float32", "bfloat16")):
        shapes = jax.eval_shape(lambda cfg=cfg: unstack_layers(
            init_params(cfg, jax.random.key(0)), cfg))
        params = jax.tree.map(lambda a, dtype=dtype: jax.ShapeDtypeStruct(
            a.shape, dtype if jnp.issubdtype(a.dtype, jnp.floating) else a.dtype,
            sharding=device), shapes)
        for key, step in ((WindowKey(8, 128), score_window_step),
                          (SharedKey(4, 128, 16, 32), score_shared_step)):
            inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                 sharding=device), _example(key))
            case = f"{name} {dtype} {type(key).__name__}"
            try:
                compiled = jax.jit(bind(step, cfg=cfg, top_n=2)).trace(params, inputs).lower(
                    lowering_platforms=("cuda",)).compile()
                module = hlo.parse(compiled.as_text())
                found = hlo.expert_by_token(module, cfg.num_experts or 0,
                                            {8 * 128, 16 * 32, 4 * 128}) if cfg.num_experts else []
                out[case] = {"ok": True, "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
                             "expert_by_token": found}
            except Exception as e:  # noqa: BLE001 - the failure is the result
                out[case] = {"ok": False, "error": str(e).splitlines()[0][:300]}
    return out


if __name__ == "__main__":
    print(json.dumps({"programs": programs, "kernels": kernels,
                      "scoring": scoring}[sys.argv[1]]()))
