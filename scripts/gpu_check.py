"""The GPU build checked on a CUDA device in one command: one markdown table, non-zero on a mismatch.

    python scripts/gpu_check.py [--hbm_gbps=4800] [--layers=8] [--mtp_k=3] [--reps=5]
    python scripts/gpu_check.py --cpu_smoke   # the same code at tiny sizes on CPU (interpret mode)

Without a GPU backend (and without --cpu_smoke) it says it needs a GPU and exits 0. Rows:

1. The Pallas decode kernel (`paged_attention_decode(impl="pallas")`, the Program's call)
   against its jnp reference at 27B attention dims (24 q / 4 kv heads x 256, page 16, a few
   hundred pages, ragged lengths with 0 and a full table; pool slots no row reads hold NaN), in
   bf16 and fp32: max abs error (pass: allclose at the kernel tests' per-dtype tolerance) and
   the median time of each. The same for the Pallas prefill kernel
   (`paged_attention_prefill(impl="pallas")`) on a 512-token chunk and a 4-token verify
   window per row after ragged cached lengths (0 to a near-full table), with ragged chunk
   lengths (full, one, none, part) and NaN in every chunk padding row. Both kernels again on
   INT8 pages with their scales (`kv_dtype="int8"`, bf16 queries; NaN scales where no row
   reads), against the reference on the same pages. The GDN kernels
   (`pallas_kernels.gdn`) against the model's jnp forms at the 27B's GDN dims: decode (B = max
   concurrency), a 4-token verify window (every token's state) and a 512-token prefill: the
   kernel's and the jnp form's errors on the device against the jnp form in IEEE fp32 on the
   host (the kernel passes within 1e-4), both times, both against the floor of the bytes the
   state and inputs must move. The
   fused-dequantize matmul (`pallas_kernels.quant_matmul`) with int8, int4 and FP8 weights at
   the 27B's MLP up-projection (17408 x 5120; dims rounded up to 128 at tiny sizes), and FP8
   x FP8 (`fp8_activations`, Hopper), B = max concurrency bf16 rows, against its jnp
   reference: relative error, both times, the kernel against the floor of the weight's bytes.
   The grouped matmul (`pallas_kernels.grouped_matmul` through `layers.experts_kernel`) at the
   35B-A3B's expert dims with bf16, int4 and FP8 experts, decode-sized (B = max concurrency
   tokens) and prefill-sized random top-k routing, against the jnp gather path: error, both
   times, the kernel against the floor of the selected experts' bytes.
2. Decode (B = 1 and max B) and MTP verify rounds (K drafts) of the 27B and 35B-A3B presets
   through the real Program (bf16, random weights of the real per-layer shapes), cut to
   `--layers` layers (every 4th full attention). A round is the suite helper
   `_spec_sides.RoundSide`'s decode + commit, which waits for the step's tokens; plain decode
   also runs rounds ahead (committed unread, the next round taking the tokens on the device,
   as the Engine does), with the host's dispatch time of a round. The rounds-ahead time (a
   verify round's own for MTP) is scaled to the full depth by the bytes a round must move (the
   layers linearly, the
   embedding and lm head once) and set against the HBM floor: weights read (MoE: the experts
   random routing is expected to touch) + K/V read + GDN state read once and written per
   position, at `--hbm_gbps`.
3. Prefill of one `prefill_chunk`-token prompt (admit, one chunk, release) on the same
   Programs, scaled to the full depth by layer count (the lm head runs on one position).
4. Every executable each Program asked for (prefill, commit, decode for every exact B) is
   compiled: the table's keys against the expected set, after `wait_compiled()`.
5. `platform_defaults` for the running backend and what `ProgramConfig()` resolves to.
6. MoE prefill at the 35B's dims (4 layers): 64 experts top-2 against 2 experts top-2.

All Programs are built first and compiled together (each Program's background thread
compiles its decode steps while the next Program's prefill compiles), then every timing runs
with no compile in flight, each block after a second of busy matmuls (an idle GPU's clocks
are low): medians of `--reps` after one warm-up, `time.perf_counter` around work that ends in
`block_until_ready` or a read of the step's tokens. Each row is logged to stderr as it is
measured (a run cut short keeps them); `--part` runs the kernels or the Programs alone. The
first run on an H200 is `results/gpu_check_h200_2026-12-04.md`. Status "pass"/"FAIL" for
checks, "info" for measurements with no target yet.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from ninfer_jax.compile_cache import enable_persistent_cache
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.models.qwen3_6.weights import init_params, param_shapes
from ninfer_jax.presets import QWEN3_6_27B, QWEN3_6_35B_A3B, pattern
from ninfer_jax.program.config import ProgramConfig, platform_defaults
from ninfer_jax.program.executables import StepKind
from ninfer_jax.program.program import Program
from ninfer_jax.testing.configs import tiny_dense, tiny_moe
from pallas_kernels.paged_attention import (
    PagedAttentionInputs,
    paged_attention_decode,
    paged_attention_prefill,
    quantize,
)
from scripts.benchmarks._spec_sides import RoundSide, _prefill, program_config

H200_HBM_GBPS = 4800.0  # H200 HBM3e, 4.8 TB/s
TOLERANCES = {"float32": 1e-5, "bfloat16": 2e-2}  # atol and rtol, as tests/pallas_kernels'
EXPECTED_DEFAULTS = {
    "gpu": {"dtype": "bfloat16", "attention_impl": "pallas", "gdn_impl": "pallas_verify",
            "layer_loop": "unrolled"},
    "cpu": {"dtype": "float32", "attention_impl": "reference", "gdn_impl": "reference",
            "layer_loop": "unrolled"}}

CPU_SMOKE = flags.DEFINE_bool("cpu_smoke", False, "run at tiny sizes on CPU (kernels interpreted)")
SCALE = flags.DEFINE_enum("scale", None, ["full", "tiny"],
                          "sizes: full (27B/35B dims) or tiny; default full, tiny with cpu_smoke")
HBM_GBPS = flags.DEFINE_float("hbm_gbps", H200_HBM_GBPS, "HBM bandwidth for the floor, GB/s")
LAYERS = flags.DEFINE_integer("layers", None, "layers built (a multiple of 4); default 8, tiny 4")
MTP_K = flags.DEFINE_integer("mtp_k", None, "MTP drafts per verify round; default 3, tiny 1")
MAX_CONCURRENCY = flags.DEFINE_integer(
    "max_concurrency", None, "the Programs' max B (decode compiles every B up to it; B=1 and "
    "it are timed); default 8, tiny 2", lower_bound=1, upper_bound=64)
REPS = flags.DEFINE_integer("reps", 5, "timed repetitions after one warm-up", lower_bound=1)
PART = flags.DEFINE_enum("part", "all", ["all", "kernels", "programs"],
                         "kernels: row 1 and 5 only; programs: rows 2-6 only")


@dataclasses.dataclass(frozen=True)
class KernelDims:
    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    max_pages: int  # per row; the pool holds batch * max_pages + 3 pages
    chunk: int  # query tokens per row of the prefill kernel's case


@dataclasses.dataclass(frozen=True)
class Sizes:
    models: tuple[tuple[str, ModelConfig, ModelConfig], ...]  # (name, built, full depth)
    moe_pair: tuple[ModelConfig, ModelConfig]  # 64 experts top-2, 2 experts top-2
    kernel: KernelDims
    max_concurrency: int
    prompt_len: int  # = prefill_chunk: a prompt is one chunk
    mtp_k: int
    rounds: int  # decode rounds per repetition


def sizes(scale: str, layers: int | None = None, mtp_k: int | None = None,
          max_concurrency: int | None = None) -> Sizes:
    """The configs of one run: "full" cuts the presets to `layers`; "tiny" the test configs."""
    if scale == "full":
        n = layers or 8
        models = tuple((name, dataclasses.replace(cfg, layer_types=pattern(n)), cfg)
                       for name, cfg in (("27B", QWEN3_6_27B), ("35B-A3B", QWEN3_6_35B_A3B)))
        moe = dataclasses.replace(QWEN3_6_35B_A3B, layer_types=pattern(4), mtp_num_layers=0)
        kernel = KernelDims(8, 24, 4, 256, 16, 64, 512)
        return Sizes(models, _moe_pair(moe), kernel, max_concurrency or 8, 512, mtp_k or 3, 16)
    n = layers or 4
    dense = tiny_dense(layer_types=pattern(n), mtp_num_layers=1)
    moe = tiny_moe(layer_types=pattern(n), mtp_num_layers=1)
    models = (("tiny dense", dense, dataclasses.replace(dense, layer_types=pattern(4 * n))),
              ("tiny MoE", moe, dataclasses.replace(moe, layer_types=pattern(4 * n))))
    kernel = KernelDims(5, 6, 2, 64, 8, 7, 16)
    return Sizes(models, _moe_pair(dataclasses.replace(moe, mtp_num_layers=0)), kernel,
                 max_concurrency or 2, 32, mtp_k or 1, 2)


def _moe_pair(cfg: ModelConfig) -> tuple[ModelConfig, ModelConfig]:
    return (dataclasses.replace(cfg, num_experts=64, num_experts_per_tok=2),
            dataclasses.replace(cfg, num_experts=2, num_experts_per_tok=2))


@functools.partial(jax.jit, static_argnums=(0, 2))
def random_params(cfg: ModelConfig, key: jax.Array, num_mtp_layers: int) -> dict:
    """`init_params` in bf16 as one executable (eagerly, each leaf's ops compile on their own:
    about 20 s cold for a tiny config on 2 CPU cores)."""
    return init_params(cfg, key, jnp.bfloat16, num_mtp_layers)


def _bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def log(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def median_seconds(fn, reps: int, warmup: int = 1) -> float:
    """Median wall seconds of `fn()` (which must wait for its device work) after `warmup`."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# 1. The decode kernel -------------------------------------------------------------------------
def pool_case(d: KernelDims, lengths: np.ndarray, rng) -> tuple[np.ndarray, ...]:
    """(k_pages, v_pages, page_tables) for rows of `lengths` cached positions: a shuffled pool
    of `batch * max_pages + 3` pages, garbage table entries past each row's pages, NaN in every
    pool slot no row reads."""
    num_pages = d.batch * d.max_pages + 3
    shape = (num_pages, d.page_size, d.num_kv_heads, d.head_dim)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    tables = rng.permutation(num_pages)[: d.batch * d.max_pages].reshape(d.batch, d.max_pages)
    used = np.zeros((num_pages, d.page_size), bool)
    for row, n in enumerate(lengths):
        pos = np.arange(n)
        used[tables[row, pos // d.page_size], pos % d.page_size] = True
        tables[row, -(-n // d.page_size):] = rng.choice([-7, 0, num_pages + 11])
    k[~used], v[~used] = np.nan, np.nan
    return k, v, tables


def kernel_case(d: KernelDims, dtype, seed: int = 0) -> tuple[jax.Array, PagedAttentionInputs]:
    """(q, inputs) for decode on the device: ragged rows (0, 1, a page, several pages and a
    part, a full table, random), garbage table entries past each row's pages, NaN in every pool
    slot no row reads."""
    rng = np.random.default_rng(seed)
    full = d.max_pages * d.page_size
    lens = [0, 1, d.page_size, 3 * d.page_size + 5, full]
    lens = (lens + rng.integers(1, full + 1, max(d.batch - len(lens), 0)).tolist())[: d.batch]
    lengths = np.asarray(rng.permutation(lens), np.int32)
    k, v, tables = pool_case(d, lengths, rng)
    q = rng.standard_normal((d.batch, d.num_q_heads, d.head_dim))
    return (jnp.asarray(q, dtype),
            PagedAttentionInputs(jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                                 jnp.asarray(tables, jnp.int32), jnp.asarray(lengths)))


def int8_pages(args: tuple[jax.Array, PagedAttentionInputs]
               ) -> tuple[jax.Array, PagedAttentionInputs]:
    """(q, inputs) with the pages as INT8 and their scales: NaN scales (and any value) where no
    row reads."""
    q, inputs = args
    pages = []
    for x in (inputs.k_pages, inputs.v_pages):
        unread = jnp.isnan(x).any(axis=-1)
        p, s = quantize(jnp.nan_to_num(x))
        pages.append((p, jnp.where(unread, jnp.nan, s)))
    (kq, ks), (vq, vs) = pages
    return q, dataclasses.replace(inputs, k_pages=kq, v_pages=vq, k_scales=ks, v_scales=vs)


def kernel_rows(d: KernelDims, reps: int) -> list[tuple]:
    rows = []
    for dtype, pages in (("bfloat16", ""), ("float32", ""), ("bfloat16", "int8")):
        label = dtype + (f", {pages} pages" if pages else "")
        pool = int8_pages if pages else (lambda a: a)
        args = pool(kernel_case(d, jnp.dtype(dtype)))
        case = (f"{label}, B={d.batch}, {d.num_q_heads} q / {d.num_kv_heads} kv x {d.head_dim}, "
                f"page {d.page_size}, {args[1].k_pages.shape[0]} pages, "
                f"lengths {sorted(int(n) for n in args[1].cached_lens)}")
        try:
            rows.append(("1 decode kernel", case,
                         *kernel_result(paged_attention_decode, args, dtype, reps)))
        except Exception as e:  # noqa: BLE001 (a kernel that fails to build is a FAIL row)
            rows.append(("1 decode kernel", case, failure(e), "FAIL"))
        for tokens in (d.chunk, 4):  # a prefill chunk and a verify window (MTP K = 3)
            args = pool(prefill_case(d, tokens, jnp.dtype(dtype)))
            prior, chunk = args[1].cached_lens, args[1].chunk_lens
            case = (f"{label}, B={d.batch}, T={tokens}, prior {sorted(int(n) for n in prior)}, "
                    f"chunk lengths {sorted(int(n) for n in chunk)}")
            try:
                rows.append(("1 prefill kernel", case,
                             *kernel_result(paged_attention_prefill, args, dtype, reps)))
            except Exception as e:  # noqa: BLE001
                rows.append(("1 prefill kernel", case, failure(e), "FAIL"))
    return rows


def prefill_case(d: KernelDims, tokens: int, dtype) -> tuple[jax.Array, PagedAttentionInputs]:
    """(q, inputs) for prefill: `tokens` query tokens per row after ragged cached lengths (0, a
    page and a part, near a full table), ragged chunk lengths (full, one, none, part), NaN in
    every pool slot and chunk padding row no row reads."""
    rng = np.random.default_rng(tokens)
    room = d.max_pages * d.page_size - tokens
    prior = [0, d.page_size + 3, room, int(rng.integers(0, room + 1))]
    chunk = [tokens, 1, 0, max(1, tokens // 2 + 1)]
    prior = np.asarray([prior[i % 4] for i in range(d.batch)], np.int32)
    chunk = np.asarray([chunk[(i + 1) % 4] for i in range(d.batch)], np.int32)
    k, v, tables = pool_case(d, prior, rng)
    own = (d.batch, tokens, d.num_kv_heads, d.head_dim)
    ck, cv = rng.standard_normal(own), rng.standard_normal(own)
    for row, n in enumerate(chunk):
        ck[row, n:], cv[row, n:] = np.nan, np.nan
    q = rng.standard_normal((d.batch, tokens, d.num_q_heads, d.head_dim))
    return (jnp.asarray(q, dtype),
            PagedAttentionInputs(jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                                 jnp.asarray(tables, jnp.int32), jnp.asarray(prior),
                                 chunk_k=jnp.asarray(ck, dtype), chunk_v=jnp.asarray(cv, dtype),
                                 chunk_lens=jnp.asarray(chunk)))


def kernel_result(entry, args: tuple[jax.Array, PagedAttentionInputs], dtype: str,
                  reps: int) -> tuple[str, str]:
    """(result, status) of `entry`'s kernel against its reference on `args` (q, inputs)."""
    fns = {impl: jax.jit(functools.partial(entry, impl=impl))
           for impl in ("pallas", "reference")}
    out = {impl: np.asarray(jax.block_until_ready(f(*args)).astype(jnp.float32))
           for impl, f in fns.items()}
    err = float(np.max(np.abs(out["pallas"] - out["reference"])))
    tol = TOLERANCES[dtype]
    ok = bool(np.all(np.isfinite(out["pallas"]))) and np.allclose(
        out["pallas"], out["reference"], atol=tol, rtol=tol)
    ms = {impl: 1e3 * median_seconds(
                    lambda f=f, args=args: jax.block_until_ready(f(*args)), 4 * reps)
          for impl, f in fns.items()}
    result = (f"max abs err {err:.2e} (tol {tol:g}); kernel {ms['pallas']:.3f} ms, reference "
              f"{ms['reference']:.3f} ms ({ms['reference'] / ms['pallas']:.2f}x)")
    return result, "pass" if ok else "FAIL"


# 1. The GDN kernels ---------------------------------------------------------------------------
def gdn_case(cfg: ModelConfig, batch: int, tokens: int, seed: int = 0) -> tuple:
    """(q, k, v, g, beta, state) as a GDN layer of `cfg` feeds the rule: l2-normalised q
    (scaled) and k, g < 0, beta in (0, 1), fp32 state; the last row ends in padding (g = beta
    = 0) after half its tokens."""
    from ninfer_jax.models.qwen3_6.gdn import _l2norm

    rng = np.random.default_rng(seed)
    h, dk, dv = cfg.linear_num_v_heads, cfg.linear_k_dim, cfg.linear_v_dim

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    valid = (np.arange(tokens)[None, :] < np.asarray([tokens] * (batch - 1)
                                                     + [max(1, tokens // 2)])[:, None])
    valid = jnp.asarray(valid)[..., None]
    g = jnp.where(valid, -jnp.abs(normal(batch, tokens, h)) * 0.5, 0.0)
    beta = jnp.where(valid, jax.nn.sigmoid(normal(batch, tokens, h)), 0.0)
    return (_l2norm(normal(batch, tokens, h, dk)) * dk**-0.5, _l2norm(normal(batch, tokens, h, dk)),
            normal(batch, tokens, h, dv), g, beta, normal(batch, h, dk, dv))


def gdn_rows(cfg: ModelConfig, batch: int, chunk: int, reps: int, gbps: float) -> list[tuple]:
    """The GDN kernels against the model's jnp forms (the Program's reference path) at `cfg`'s
    GDN dims: decode (T = 1, B rows), a verify window (T = 4, every token's state), prefill
    (one `chunk`-token row). Each row: max abs error, both times, and both against the floor
    of the state's bytes (read once, written once or once per token) at `gbps`."""
    from ninfer_jax.models.qwen3_6.gdn import chunked_delta_rule, recurrent_delta_rule
    from pallas_kernels.gdn import gated_delta_rule

    rows = []
    for name, b, tokens, keep in (("decode", batch, 1, False), ("verify", batch, 4, True),
                                  ("prefill", 1, chunk, False)):
        args = gdn_case(cfg, b, tokens)
        case = (f"{name}, B={b}, T={tokens}, {cfg.linear_num_v_heads} heads x "
                f"{cfg.linear_k_dim} x {cfg.linear_v_dim}")
        if name == "prefill":
            reference = functools.partial(chunked_delta_rule, chunk_size=cfg.gdn_chunk_size)
        else:
            reference = functools.partial(recurrent_delta_rule, keep_states=keep)
        fns = {"pallas": jax.jit(functools.partial(gated_delta_rule, keep_states=keep,
                                                   chunk_size=cfg.gdn_chunk_size)),
               "reference": jax.jit(reference)}
        try:
            out = {impl: [np.asarray(a) for a in jax.block_until_ready(f(*args))]
                   for impl, f in fns.items()}
            # The truth: the jnp form in IEEE fp32 on the host (XLA's GPU dots take fp32
            # operands as TF32, which put the jnp form 2-4e-4 off the kernels on the H200).
            cpu = jax.devices("cpu")[0]
            truth = [np.asarray(a) for a in jax.jit(reference)(*jax.device_put(args, cpu))]
            err = {impl: max(float(np.max(np.abs(x - y))) for x, y in zip(o, truth, strict=True))
                   for impl, o in out.items()}
            ok = err["pallas"] <= 1e-4 and all(np.all(np.isfinite(a)) for a in out["pallas"])
            ms = {impl: 1e3 * median_seconds(lambda f=f, a=args: jax.block_until_ready(f(*a)),
                                              4 * reps) for impl, f in fns.items()}
        except Exception as e:  # noqa: BLE001
            rows.append(("1 GDN kernel", case, failure(e), "FAIL"))
            continue
        state = args[5].nbytes
        moved = state * (1 + (tokens if keep else 1)) + sum(a.nbytes for a in args[:5]) + (
            b * tokens * cfg.linear_num_v_heads * cfg.linear_v_dim * 4)
        floor = 1e3 * moved / (gbps * 1e9)
        result = (f"max abs err against IEEE fp32 {err['pallas']:.2e} (tol 1e-4; the jnp form "
                  f"here {err['reference']:.2e}); kernel {ms['pallas']:.3f} ms "
                  f"({ms['pallas'] / floor:.2f}x floor), jnp {ms['reference']:.3f} ms "
                  f"({ms['reference'] / floor:.2f}x floor); floor {floor:.4f} ms "
                  f"({_bytes(moved)} at {gbps:g} GB/s)")
        rows.append(("1 GDN kernel", case, result, "pass" if ok else "FAIL"))
    return rows


def quant_rows(cfg: ModelConfig, batch: int, reps: int, gbps: float) -> list[tuple]:
    """The fused-dequantize matmul (`pallas_kernels.quant_matmul`) against its jnp reference at
    `cfg`'s MLP up-projection [intermediate, hidden] (the largest dense weight a decode step
    reads), int8, int4 and FP8 (128 x 128 blocks), B rows of bf16 activations. Each row: max
    relative error, both times, the kernel against the floor of the weight's bytes at `gbps`."""
    from ninfer_jax import quant
    from pallas_kernels.quant_matmul import quant_matmul, quant_matmul_reference

    n, k = (-(-d // 128) * 128 for d in (cfg.intermediate_size or cfg.moe_intermediate_size,
                                          cfg.hidden_size))
    interpret = jax.default_backend() == "cpu"
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    x = jnp.asarray(rng.standard_normal((batch, k)), jnp.bfloat16)
    rows = []
    for method, fp8_act in (("int8", False), ("int4", False), ("fp8", False), ("fp8", True)):
        qa = quant.fp8_blocks(w) if method == "fp8" else quant.quantize_int(w, method)
        args = (x, jnp.asarray(qa.q), jnp.asarray(qa.scale))
        case = f"{method}{' x fp8' if fp8_act else ''}, [{n}, {k}] weight, B={batch}"
        kernel = functools.partial(quant_matmul, interpret=interpret)
        fns = {impl: jax.jit(functools.partial(f, method=method, group=qa.block[1],
                                               fp8_activations=fp8_act))
               for impl, f in (("pallas", kernel), ("reference", quant_matmul_reference))}
        try:
            out = {impl: np.asarray(jax.block_until_ready(f(*args))) for impl, f in fns.items()}
            err = float(np.max(np.abs(out["pallas"] - out["reference"]))
                        / np.max(np.abs(out["reference"])))
            ms = {impl: 1e3 * median_seconds(lambda f=f, a=args: jax.block_until_ready(f(*a)),
                                              4 * reps) for impl, f in fns.items()}
        except Exception as e:  # noqa: BLE001
            rows.append(("1 quant matmul", case, failure(e), "FAIL"))
            continue
        moved = qa.nbytes + x.nbytes + batch * n * 4
        floor = 1e3 * moved / (gbps * 1e9)
        result = (f"max rel err {err:.2e} (tol 2e-2, bf16 tiles); kernel {ms['pallas']:.3f} ms "
                  f"({ms['pallas'] / floor:.2f}x floor), jnp {ms['reference']:.3f} ms; floor "
                  f"{floor:.4f} ms ({_bytes(moved)} at {gbps:g} GB/s)")
        rows.append(("1 quant matmul", case, result, "pass" if err <= 2e-2 else "FAIL"))
    return rows


def grouped_rows(cfg: ModelConfig, batch: int, tokens: int, reps: int,
                 gbps: float) -> list[tuple]:
    """An MoE layer's routed experts through the Pallas grouped matmul (`layers.
    experts_kernel`: the fused SwiGLU then down over rows sorted by expert) against the gather
    path (`experts_on_cpu`, jnp) at `cfg`'s expert dims, bf16, int4 and FP8 experts, random
    top-k routing of `batch` (decode) and `tokens` (prefill) tokens. Each row: max relative
    error, both times, the kernel against the floor of the selected experts' bytes."""
    from ninfer_jax import quant
    from ninfer_jax.models.qwen3_6.layers import experts_kernel, experts_on_cpu

    e, h, i_dim, k = (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                      cfg.num_experts_per_tok)
    interpret = jax.default_backend() == "cpu"
    rng = np.random.default_rng(1)
    weights = {"gate": (e, i_dim, h), "up": (e, i_dim, h), "down": (e, h, i_dim)}
    floats = {n: (rng.standard_normal(s) * 0.02).astype(np.float32) for n, s in weights.items()}
    rows = []
    for method in (None, "int4", "fp8"):
        if method is None:
            ex = {n: jnp.asarray(w, jnp.bfloat16) for n, w in floats.items()}
        else:
            ex = {n: jax.tree.map(jnp.asarray, quant.fp8_blocks(w) if method == "fp8"
                                  else quant.quantize_int(w, method))
                  for n, w in floats.items()}
        per_expert = sum(quant.weight_bytes({"w": w}) for w in ex.values()) / e
        for n in (batch, tokens):
            x = jnp.asarray(rng.standard_normal((n, h)), jnp.bfloat16)
            probs = jax.nn.softmax(jnp.asarray(rng.standard_normal((n, e)), jnp.float32))
            top_w, top_i = jax.lax.top_k(probs, k)
            top_w = (top_w / top_w.sum(-1, keepdims=True)).astype(jnp.bfloat16)
            args = (ex, x, top_i, top_w)
            case = f"{method or 'bf16'} experts [{e}, {i_dim}, {h}], {n} tokens top-{k}"
            fns = {"pallas": jax.jit(functools.partial(experts_kernel, interpret=interpret)),
                   "jnp": jax.jit(experts_on_cpu)}
            try:
                out = {impl: np.asarray(jax.block_until_ready(f(*args)), np.float32)
                       for impl, f in fns.items()}
                err = float(np.max(np.abs(out["pallas"] - out["jnp"]))
                            / np.max(np.abs(out["jnp"])))
                ms = {impl: 1e3 * median_seconds(
                    lambda f=f, args=args: jax.block_until_ready(f(*args)),
                    4 * reps) for impl, f in fns.items()}
            except Exception as exc:  # noqa: BLE001
                rows.append(("1 grouped matmul", case, failure(exc), "FAIL"))
                continue
            selected = len(np.unique(np.asarray(top_i)))
            floor = 1e3 * selected * per_expert / (gbps * 1e9)
            result = (f"max rel err {err:.2e} (tol 2e-2); kernel {ms['pallas']:.3f} ms "
                      f"({ms['pallas'] / floor:.2f}x the floor of {selected} experts' "
                      f"{_bytes(selected * per_expert)}), jnp gather/dense {ms['jnp']:.3f} ms")
            rows.append(("1 grouped matmul", case, result, "pass" if err <= 2e-2 else "FAIL"))
    return rows


# 2. Bytes a round must move --------------------------------------------------------------------
def _numel(tree) -> int:
    return sum(math.prod(s) for s in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, tuple)))


def _layer_elems(cfg: ModelConfig, stacked: dict, tokens: int) -> int:
    """Weights of stacked layers read for `tokens` tokens: MoE experts only as many as random
    top-k routing is expected to touch, E * (1 - (1 - k/E)^tokens)."""
    if not stacked:
        return 0
    total = _numel(stacked)
    if cfg.variant == "moe":
        frac = 1.0 - (1.0 - cfg.num_experts_per_tok / cfg.num_experts) ** tokens
        total -= round(_numel(stacked["mlp"]["experts"]) * (1.0 - frac))
    return total


def round_bytes(cfg: ModelConfig, b: int, k: int, ctx: int, itemsize: int = 2) -> int:
    """The least a decode (k = 0) or MTP verify round of b rows at context ctx reads/writes:
    weights (the verify: the model over T = k + 1 positions, k drafts each through the head
    and the lm head, and the head once more over T to rewrite its K/V), attention K/V read
    (the head's layer once per pass), GDN state read once and written for every position."""
    t = k + 1
    s = param_shapes(cfg, num_mtp_layers=cfg.mtp_num_layers if k else 0)
    head = _numel(s.get("lm_head", s["embed"]))
    weights = (_layer_elems(cfg, s["linear"], b * t) + _layer_elems(cfg, s["attention"], b * t)
               + head + b * t * cfg.hidden_size)
    kv_layers = cfg.num_attention_layers
    if k:
        mtp = s["mtp"]

        def mtp_elems(tokens: int) -> int:
            return _numel(mtp) - _numel(mtp["layers"]) + _layer_elems(cfg, mtp["layers"], tokens)

        weights += k * (mtp_elems(b) + head) + mtp_elems(b * t)
        kv_layers += (k + 1) * cfg.mtp_num_layers
    kv = kv_layers * b * ctx * 2 * cfg.num_kv_heads * cfg.head_dim
    rec = cfg.linear_num_v_heads * cfg.linear_k_dim * cfg.linear_v_dim * 4
    conv = cfg.conv_dim * (cfg.conv_kernel - 1) * itemsize
    state = cfg.num_linear_layers * b * (rec + conv) * (1 + t)
    return (weights + kv) * itemsize + state


# Programs --------------------------------------------------------------------------------------
@dataclasses.dataclass
class Built:
    name: str  # the model: "27B", "35B-A3B", "MoE"
    label: str  # "27B decode", "27B verify K=3", "MoE 64x top-2"
    cfg: ModelConfig
    full: ModelConfig
    k: int
    program: Program | None  # None: its construction failed (error)
    compile_s: float = 0.0
    error: str | None = None  # the first failure building or compiling it


def failure(e: BaseException) -> str:
    """A one-line account of `e` for the table (the traceback goes to stderr)."""
    traceback.print_exception(e, file=sys.stderr)
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:240]}"


def build_all(s: Sizes, reps: int) -> list[Built]:
    """Every Program of rows 2-4 and 6, constructed in turn (each compiles its prefill before
    returning, while the others' background threads compile their decode steps; the verify
    Programs, with the most to compile, first), then waited for."""
    total_rounds = s.rounds * (1 + reps)
    built = []

    def make(name, label, cfg, full, params, k, bmax, extra_tokens):
        pcfg = dataclasses.replace(
            program_config(k, bmax, s.prompt_len + extra_tokens, s.prompt_len),
            dtype="bfloat16", attention_impl="pallas", gdn_impl="pallas")
        log(f"building {label} ({cfg.num_layers} layers, max_concurrency {bmax})")
        try:
            built.append(Built(name, label, cfg, full, k, Program(cfg, params, pcfg)))
        except Exception as e:  # noqa: BLE001 (reported in the table; the run goes on)
            built.append(Built(name, label, cfg, full, k, None, error=failure(e)))

    for i, (name, cfg, full) in enumerate(s.models):
        log(f"random bf16 weights for {name} ({cfg.num_layers} layers, MTP {cfg.mtp_num_layers})")
        params = random_params(cfg, jax.random.key(i), cfg.mtp_num_layers)
        if cfg.mtp_num_layers:
            make(name, f"{name} verify K={s.mtp_k}", cfg, full, params, s.mtp_k,
                 s.max_concurrency, 1 + total_rounds * (s.mtp_k + 1))
        plain = {key: value for key, value in params.items() if key != "mtp"}
        make(name, f"{name} decode", cfg, full, plain, 0, s.max_concurrency, 1 + total_rounds)
        del params, plain
    for j, cfg in enumerate(s.moe_pair):
        params = random_params(cfg, jax.random.key(10 + j), 0)
        make("MoE", f"MoE {cfg.num_experts}x top-{cfg.num_experts_per_tok}", cfg, cfg, params,
             0, 1, 1)
        del params
    for b in built:
        if b.program is None:
            continue
        start = time.perf_counter()
        try:
            b.program.wait_compiled()
        except Exception as e:  # noqa: BLE001
            b.error = failure(e)
        b.compile_s = sum(b.program.executables.compile_seconds.values())
        log(f"{b.label}: {'compile failed' if b.error else 'all compiled'} ({b.compile_s:.1f} s "
            f"of compiles, waited {time.perf_counter() - start:.1f} s more)")
    return built


def executables_row(b: Built) -> tuple:
    """Row 4: the table's keys against prefill(1), commit(max B), decode(1..max B)."""
    if b.program is None:
        return ("4 executables", b.label, f"not built: {b.error}", "FAIL")
    table, bmax = b.program.executables, b.program.pcfg.max_concurrency
    want = {(StepKind.PREFILL, 1), (StepKind.COMMIT, bmax)} | {
        (StepKind.DECODE, n) for n in range(1, bmax + 1)}
    keys = {(key.kind, key.batch) for key in table.keys()}  # noqa: SIM118 (not a dict)
    done = {(key.kind, key.batch) for key in table.compile_seconds}
    missing = sorted(f"{kind.value}({n})" for kind, n in want - (keys & done))
    by_kind: dict[str, list[int]] = {}
    for kind, n in sorted(keys, key=lambda x: (x[0].value, x[1])):
        by_kind.setdefault(kind.value, []).append(n)
    listed = " ".join(f"{kind}({ns[0]}-{ns[-1]})" if len(ns) > 1 else f"{kind}({ns[0]})"
                      for kind, ns in by_kind.items())
    ok = not missing and not table.pending() and b.error is None
    result = (f"{len(keys)} keys: {listed}; " + ("none missing" if not missing
                                                 else f"MISSING {', '.join(missing)}")
              + f"; {b.compile_s:.1f} s of compiles" + (f"; {b.error}" if b.error else ""))
    return ("4 executables", b.label, result, "pass" if ok else "FAIL")


def prefill_ms(b: Built, prompt: list[int], reps: int) -> float:
    prog = b.program

    def once() -> None:
        handle = prog.materialize(prog.plan_admission(len(prompt), 1), prompt)
        _prefill(prog, handle)  # waits for the chunk's token
        prog.release(handle)

    return 1e3 * median_seconds(once, reps)


def round_ms(b: Built, prompts: list[list[int]], s: Sizes, reps: int) -> tuple[float, float]:
    """(median ms per round, tokens committed per round) over `reps` repetitions of
    `s.rounds` rounds on all rows, after one warm-up repetition."""
    side = RoundSide(b.program, b.k, s.rounds, s.rounds * (1 + reps))
    side.prepare("round", {"prompts": prompts})
    results = [side.rep("round") for _ in range(1 + reps)][1:]
    side.finish("round")
    ms = statistics.median(1e3 * r["seconds"] / s.rounds for r in results)
    tokens = sum(r["outputs"]["tally"]["committed"] for r in results) / (s.rounds * reps)
    return ms, tokens


def chained_round_ms(b: Built, prompts: list[list[int]], s: Sizes,
                     reps: int) -> tuple[float, float]:
    """(median ms per plain decode round dispatched ahead, median ms the host spent
    dispatching one): each round committed without reading its tokens (the next round takes
    them on the device: `HostProgram.commit`'s unread commit, what the Engine's rounds ahead
    do), the tokens read once after the last round. Against `round_ms` (a round that reads
    its tokens) the difference is the host time a round exposes; a dispatch time close to
    the round's means the host, not the device, sets the pace."""
    side = RoundSide(b.program, 0, s.rounds, s.rounds * (1 + reps))
    side.prepare("round", {"prompts": prompts})
    prog, handles, ones = b.program, side.handles, [1] * len(side.handles)
    rounds, dispatched = [], []
    for _ in range(1 + reps):
        start = time.perf_counter()
        for _ in range(s.rounds):
            prog.commit(prog.decode(handles), ones)
        dispatched.append(time.perf_counter() - start)
        prog.tokens(handles[0])  # waits for the last round's step
        rounds.append(time.perf_counter() - start)
    side.finish("round")
    return tuple(1e3 * statistics.median(t[1:]) / s.rounds for t in (rounds, dispatched))


def warm_device(seconds: float = 1.0) -> None:
    """Busy bf16 matmuls for `seconds` before a block of timings: an idle GPU runs at low
    clocks (an H200's SMs at 345 MHz idle) and takes a while to raise them; in the first
    H200 run the first timings of each Program (decode at B = 1) were slower than B = 8's."""
    if jax.default_backend() != "gpu":
        return
    x = jnp.ones((4096, 4096), jnp.bfloat16)
    square = jax.jit(lambda a: a @ a)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        square(x).block_until_ready()


def step_rows(b: Built, s: Sizes, reps: int, gbps: float, decode_ms: dict) -> list[tuple]:
    """Rows 2 and 3 of one Program (prefill on the decode Programs only); a failure while
    running is a FAIL row."""
    if b.program is None or b.error:
        return [(f"2 {'verify' if b.k else 'decode'}", b.label, "not run: see row 4", "FAIL")]
    try:
        return _step_rows(b, s, reps, gbps, decode_ms)
    except Exception as e:  # noqa: BLE001
        return [(f"2 {'verify' if b.k else 'decode'}", b.label, failure(e), "FAIL")]


def _step_rows(b: Built, s: Sizes, reps: int, gbps: float, decode_ms: dict) -> list[tuple]:
    rng = np.random.default_rng(0)
    bmax = b.program.pcfg.max_concurrency
    prompts = rng.integers(0, b.cfg.vocab_size, (bmax, s.prompt_len)).tolist()
    depth = f"{b.cfg.num_layers} of {b.full.num_layers} layers"
    rows = []
    if b.k == 0:
        ms = prefill_ms(b, prompts[0], reps)
        full_ms = ms * b.full.num_layers / b.cfg.num_layers
        result = (f"{ms:.2f} ms at {depth}; est. full depth {full_ms:.1f} ms, "
                  f"{1e3 * s.prompt_len / full_ms:,.0f} tok/s")
        rows.append(("3 prefill", f"{b.name}, {s.prompt_len}-token chunk", result, "info"))
    ctx = s.prompt_len + s.rounds * (1 + reps) // 2
    for batch in sorted({1, bmax}):
        ms, tokens = round_ms(b, prompts[:batch], s, reps)
        built_bytes = round_bytes(b.cfg, batch, b.k, ctx)
        full_bytes = round_bytes(b.full, batch, b.k, ctx)
        floor_ms = 1e3 * full_bytes / (gbps * 1e9)
        note = ""
        if b.k:
            base = decode_ms.get((b.name, batch))
            note = f"; {tokens / batch:.2f} tokens/row-round (random drafts)" + (
                f"; {ms / base:.2f}x the decode round" if base else "")
            timed = ms
        else:
            decode_ms[(b.name, batch)] = ms
            # the estimate from rounds ahead (what the Engine runs), not the host's waits
            timed, dispatch = chained_round_ms(b, prompts[:batch], s, reps)
            note = (f"; rounds ahead {timed:.2f} ms/round, {dispatch:.2f} ms of it "
                    f"dispatching (the estimate's base)")
        full_ms = timed * full_bytes / built_bytes
        result = (f"{ms:.2f} ms/round at {depth}; est. full depth {full_ms:.2f} ms, "
                  f"{1e3 * tokens / full_ms:,.0f} tok/s; floor {floor_ms:.3g} ms "
                  f"({_bytes(full_bytes)} at {gbps:g} GB/s); {full_ms / floor_ms:.2f}x floor{note}")
        rows.append((f"2 {'verify' if b.k else 'decode'}", f"{b.label}, B={batch}, ctx {ctx}",
                     result, "info"))
    return rows


def moe_row(pair: list[Built], s: Sizes, reps: int) -> tuple:
    cfg = pair[0].cfg
    case = (f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, expert I "
            f"{cfg.moe_intermediate_size}, {s.prompt_len} tokens")
    if any(b.program is None or b.error for b in pair):
        return ("6 MoE prefill", case, "not run: see row 4", "FAIL")
    prompt = np.random.default_rng(1).integers(0, cfg.vocab_size, s.prompt_len).tolist()
    try:
        many, two = (prefill_ms(b, prompt, reps) for b in pair)
    except Exception as e:  # noqa: BLE001
        return ("6 MoE prefill", case, failure(e), "FAIL")
    result = (f"64 experts top-2 {many:.2f} ms, 2 experts top-2 {two:.2f} ms: "
              f"{many / two:.2f}x (later target <= 1.3x, not checked)")
    return ("6 MoE prefill", case, result, "info")


def defaults_row() -> tuple:
    backend = jax.default_backend()
    got = platform_defaults(backend)
    pcfg = ProgramConfig()
    resolved = {"dtype": pcfg.dtype, "attention_impl": pcfg.attention_impl,
                "gdn_impl": pcfg.gdn_impl, "layer_loop": pcfg.resolved_layer_loop()}
    want = EXPECTED_DEFAULTS.get(backend)
    ok = want is not None and got == want == resolved
    result = f"platform_defaults: {got}; ProgramConfig() resolves {resolved}"
    return ("5 platform defaults", f"backend {backend} ({jax.devices()[0].device_kind})", result,
            "pass" if ok else "FAIL")


def markdown(rows: list[tuple]) -> str:
    lines = ["| check | case | result | status |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(str(c).replace("|", "/") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def run(s: Sizes, scale: str, reps: int, gbps: float, part: str = "all") -> int:
    """Prints the table; returns the exit status (1 if a row failed)."""
    start = time.perf_counter()
    rows: list[tuple] = []

    def emit(new: list[tuple]) -> None:
        """Each row goes to stderr as it is measured (a run cut short keeps what it had)."""
        for row in new:
            log("row " + markdown([row]).splitlines()[-1])
        rows.extend(new)

    emit([defaults_row()])
    if part in ("all", "kernels"):
        log("row 1: kernels against their references")
        warm_device()
        emit(kernel_rows(s.kernel, reps))
        emit(gdn_rows(s.models[0][1], s.max_concurrency, s.prompt_len, reps, gbps))
        emit(quant_rows(s.models[0][1], s.max_concurrency, reps, gbps))
        emit(grouped_rows(s.models[1][1], s.max_concurrency, s.prompt_len, reps, gbps))
    compile_wall = 0.0
    if part in ("all", "programs"):
        built = build_all(s, reps)
        compile_wall = time.perf_counter() - start
        emit([executables_row(b) for b in built])
        decode_ms: dict = {}
        for b in sorted(built[:-2], key=lambda b: b.k):  # decode first: verify rows use it
            log(f"timing {b.label}")
            warm_device()
            emit(step_rows(b, s, reps, gbps, decode_ms))
        warm_device()
        emit([moe_row(built[-2:], s, reps)])
        for b in built:
            if b.program is not None:
                b.program.close()
    rows.sort(key=lambda r: r[0][0])  # by row number, stable within one
    wall = f"{time.perf_counter() - start:.0f} s ({compile_wall:.0f} s to the last compile)"
    rows.append(("wall", f"scale {scale}, jax {jax.__version__}", wall, "-"))
    print(markdown(rows), flush=True)
    failed = [r for r in rows if r[3] == "FAIL"]
    if failed:
        log(f"{len(failed)} FAIL row(s): {', '.join(r[0] + ' / ' + r[1] for r in failed)}")
    return 1 if failed else 0


def main(argv) -> int:
    del argv
    if CPU_SMOKE.value:
        jax.config.update("jax_platforms", "cpu")
    elif jax.default_backend() != "gpu":
        print(f"gpu_check needs a GPU (jax's backend here is {jax.default_backend()!r}); run it "
              f"on a CUDA device, or pass --cpu_smoke to check the script at tiny sizes on CPU.")
        return 0
    enable_persistent_cache()
    scale = SCALE.value or ("tiny" if CPU_SMOKE.value else "full")
    if LAYERS.value is not None and (LAYERS.value < 4 or LAYERS.value % 4):
        raise app.UsageError(f"--layers must be a positive multiple of 4, got {LAYERS.value}")
    s = sizes(scale, LAYERS.value, MTP_K.value, MAX_CONCURRENCY.value)
    return run(s, scale, REPS.value, HBM_GBPS.value, PART.value)


if __name__ == "__main__":
    app.run(main)
