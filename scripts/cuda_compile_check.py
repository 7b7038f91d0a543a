"""Compile the whole GPU build for a Hopper GPU on a machine without one, and read what XLA made.

    python scripts/cuda_compile_check.py --model_preset=qwen3_6_35b_a3b [--gpu=h200]
        [--dtype=bfloat16|float32] [--kv_dtype=int8] [--quantize=int8|int4|fp8]
        [--speculative=mtp|dflash [--num_speculative_tokens=K]] [--tensor_parallel=N]
        [--max_concurrency=4] [--max_seq_len=2048] [--prefill_chunk=64] [--json=PATH]
    python scripts/cuda_compile_check.py --model=DIR ...   # an HF checkpoint's config.json
    python scripts/cuda_compile_check.py --roofline        # the decode roofline table only

Runs in a venv with jax's CUDA plugin (the project's `cuda` extra; see docs/gpu.md, "Compiling
the GPU build without a GPU"): the plugin takes a target description (`program.aot.GPUS`) and
gives compile-only devices, `1x1xN` of them for --tensor_parallel=N. Every executable a Program
of these settings compiles (`executable_specs.program_executables`: prefill, commit, capture,
restore, checkpoint images, decode or the speculative round for every B) is traced from shapes
alone (no weight or pool is allocated: the 27B compiles in 24 GiB) and compiled for sm_90:
XLA:GPU's passes, the Pallas kernels through Triton and ptxas. Nothing runs.

One table row per executable: compile seconds, argument / output / temp bytes (XLA's memory
analysis, per device), the Triton kernels the optimized HLO launches, and any tensor an MoE
layer holds with the expert dimension beside a token dimension. For decode steps (tensor
parallel 1) the weight bytes the compiled step reads (`program.hlo.argument_reads`) against the
model's count (`program.roofline`). An MoE model also gets its MoE layer compiled alone at
--moe_tokens tokens: temp bytes against the routed rows' activations (N x top-k x hidden).
Then the totals: the decode step's arguments (weights + pools) plus the largest temp against
the device's memory, beside `ninfer plan`'s figure. Exits 1 when an executable fails to
compile, an MoE step holds an expert-by-token tensor, or a decode step reads more weight bytes
than the model says it must.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver here: skip cuInit

import dataclasses
import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from ninfer_jax.api import DEFAULT_DFLASH_TOKENS, DEFAULT_SPECULATIVE_TOKENS
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.presets import DRAFTERS, PRESETS
from ninfer_jax.program import hlo, roofline
from ninfer_jax.program.aot import GPUS, Compiled, abstract_params, compile_all, gpu_devices
from ninfer_jax.program.config import ProgramConfig, engine_pools, platform_defaults
from ninfer_jax.program.executables import StepKey, StepKind
from ninfer_jax.program.plan import memory_plan

MODEL_PRESET = flags.DEFINE_enum("model_preset", None, sorted(PRESETS), "a published size")
MODEL = flags.DEFINE_string("model", None, "an HF checkpoint directory (its config.json)")
GPU = flags.DEFINE_enum("gpu", "h200", sorted(GPUS), "the target (both sm_90)")
DTYPE = flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float32"], "the program dtype")
KV_DTYPE = flags.DEFINE_enum("kv_dtype", "auto", ["auto", "int8"], "K/V pages")
QUANTIZE = flags.DEFINE_enum("quantize", None, ["int8", "int4", "fp8"], "weights held so")
SPECULATIVE = flags.DEFINE_enum("speculative", "off", ["off", "mtp", "dflash"], "decode rounds")
NUM_SPEC = flags.DEFINE_integer("num_speculative_tokens", None, "K (default: Engine.open's)")
DRAFTER = flags.DEFINE_string("drafter", None, "a DFlash drafter directory (default: the "
                              "preset's public drafter's sizes)")
TP = flags.DEFINE_integer("tensor_parallel", 1, "compile-only devices the model is split over",
                          lower_bound=1)
MOE_SHARDING = flags.DEFINE_enum("moe_sharding", "intermediate", ["intermediate", "expert"],
                                 "tensor_parallel's split of MoE experts")
MAX_CONCURRENCY = flags.DEFINE_integer("max_concurrency", 4, "decode for every B up to it",
                                       lower_bound=1, upper_bound=64)
MAX_SEQ_LEN = flags.DEFINE_integer("max_seq_len", 2048, "prompt + generated tokens", lower_bound=2)
PREFILL_CHUNK = flags.DEFINE_integer("prefill_chunk", 64, "tokens per prefill step")
MAX_VISION_PATCHES = flags.DEFINE_integer("max_vision_patches", 4096, "vision buckets (a "
                                          "model with a vision tower)")
LAYER_LOOP = flags.DEFINE_enum("layer_loop", "auto", ["auto", "unrolled", "scan"],
                               "auto: the GPU's default (platform_defaults)")
MOE_TOKENS = flags.DEFINE_integer("moe_tokens", 512, "tokens of the MoE layer compiled alone")
JSON = flags.DEFINE_string("json", None, "also write the results here")
ROOFLINE = flags.DEFINE_bool("roofline", False, "print the decode roofline table and exit")

DEFAULT_K = {"mtp": DEFAULT_SPECULATIVE_TOKENS, "dflash": DEFAULT_DFLASH_TOKENS}  # Engine.open's
MIB = 1 << 20


def program_config() -> ProgramConfig:
    """What Engine.open builds for these flags on a GPU: its pool sizes, the GPU's kernels."""
    settings = {}
    if SPECULATIVE.value != "off":
        settings = {"speculative": SPECULATIVE.value,
                    "num_speculative_tokens": NUM_SPEC.value or DEFAULT_K[SPECULATIVE.value]}
    gpu = platform_defaults("gpu", None if DTYPE.value == "auto" else DTYPE.value)
    pcfg = ProgramConfig(
        max_concurrency=MAX_CONCURRENCY.value, max_seq_len=MAX_SEQ_LEN.value,
        prefill_chunk=PREFILL_CHUNK.value, dtype=DTYPE.value, kv_dtype=KV_DTYPE.value,
        attention_impl=gpu["attention_impl"], gdn_impl=gpu["gdn_impl"],
        layer_loop=gpu["layer_loop"] if LAYER_LOOP.value == "auto" else LAYER_LOOP.value,
        tensor_parallel=TP.value,
        moe_sharding=MOE_SHARDING.value, max_vision_patches=MAX_VISION_PATCHES.value,
        **settings)
    return dataclasses.replace(pcfg, **engine_pools(pcfg))


def model_config() -> tuple[str, ModelConfig]:
    if (MODEL_PRESET.value is None) == (MODEL.value is None):
        raise app.UsageError("give exactly one of --model_preset=NAME and --model=DIR")
    if MODEL_PRESET.value:
        return MODEL_PRESET.value, PRESETS[MODEL_PRESET.value]
    return MODEL.value, ModelConfig.from_hf_dir(MODEL.value)


def drafter_config(name: str, cfg: ModelConfig):
    if SPECULATIVE.value != "dflash":
        return None
    if DRAFTER.value:
        from ninfer_jax.models.dflash import DFlashConfig

        return DFlashConfig.from_hf_dict(json.loads(
            (pathlib.Path(DRAFTER.value) / "config.json").read_text()))
    if name not in DRAFTERS:
        raise app.UsageError("--speculative=dflash with --model needs --drafter=DIR")
    return DRAFTERS[name]


@dataclasses.dataclass
class Findings:
    kernels: dict[str, int]
    expert_by_token: list[str]
    weights_read: float | None  # bytes of the params the step reads (decode, tp = 1)
    weights_copied: float | None  # of those, bytes a slice copied before the reader
    remat: int = 0  # ops XLA recomputes to fit the device's memory


def inspector(cfg: ModelConfig, pcfg: ProgramConfig, expert_shapes: set[tuple[int, ...]]):
    """The `inspect` of `compile_all`: what one compiled executable's optimized HLO says."""

    def inspect(key: StepKey, text: str) -> Findings:
        module = hlo.parse(text)
        width = key.extra[0] + 1 if key.extra else pcfg.verify_width  # a round of K drafts
        rows = {StepKind.DECODE: key.batch * width,
                StepKind.PREFILL: pcfg.prefill_chunk}.get(key.kind, 0)
        found = []
        if cfg.variant == "moe" and rows:
            tokens = {rows, key.batch, rows * cfg.num_experts_per_tok,
                      key.batch * cfg.num_experts_per_tok}
            found = hlo.expert_by_token(module, cfg.num_experts, tokens, expert_shapes)
        read = copied = None
        if key.kind == StepKind.DECODE and pcfg.tensor_parallel == 1:
            share = 1.0
            if cfg.variant == "moe":
                share = roofline.active_experts(cfg, rows) / cfg.num_experts
            reads = [r for name, r in hlo.argument_reads(module, share).items()
                     if name.startswith("args_0")]  # the params
            read, copied = sum(r.bytes for r in reads), sum(r.copied for r in reads)
        return Findings(hlo.triton_kernels(module), found, read, copied,
                        hlo.rematerialized(module))

    return inspect


def expert_weight_shapes(params: dict) -> set[tuple[int, ...]]:
    """The shapes of every routed expert array (stacked and per layer): weights, not
    activations, wherever they appear."""
    shapes = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if any(getattr(k, "key", None) == "experts" for k in path):
            shapes.add(tuple(leaf.shape))
            shapes.add(tuple(leaf.shape[1:]))
    return shapes


def moe_layer_row(cfg: ModelConfig, pcfg: ProgramConfig, quantize: str | None, device,
                  tokens: int) -> dict:
    """One MoE layer, its weights as the Program's layer loop holds them (per layer, or a
    stack indexed in place), compiled alone at `tokens` tokens: temp bytes against the routed
    rows' activations."""
    from jax.sharding import SingleDeviceSharding

    from ninfer_jax.models.qwen3_6.layers import layer_params, moe

    sharding = SingleDeviceSharding(device)
    params = abstract_params(cfg, pcfg, quantize)
    unrolled = "layers" in params
    weights = params["layers"][0]["mlp"] if unrolled else params["linear"]
    weights = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                           weights)
    x = jax.ShapeDtypeStruct((tokens, cfg.hidden_size), jnp.dtype(pcfg.dtype),
                             sharding=sharding)

    def layer(weights, x):
        return moe(weights if unrolled else layer_params(weights, 1)["mlp"], x, cfg)

    start = time.perf_counter()
    compiled = jax.jit(layer).trace(weights, x).lower(lowering_platforms=("cuda",)).compile()
    seconds = time.perf_counter() - start
    module = hlo.parse(compiled.as_text())
    k = cfg.num_experts_per_tok
    routed = tokens * k * cfg.hidden_size * jnp.dtype(pcfg.dtype).itemsize
    found = hlo.expert_by_token(module, cfg.num_experts, {tokens, tokens * k},
                                expert_weight_shapes(params))
    temp = int(compiled.memory_analysis().temp_size_in_bytes)
    return {"tokens": tokens, "compile_s": round(seconds, 2), "temp_bytes": temp,
            "routed_activation_bytes": routed, "temp_over_routed": temp / routed,
            "triton_kernels": hlo.triton_kernels(module), "expert_by_token_tensors": found}


def row(c: Compiled) -> str:
    if not c.ok:
        return f"| {_name(c.key)} | FAIL | {c.compile_s:.1f} | | | | {c.error.splitlines()[0][:160]} | |"
    f: Findings = c.findings
    kernels = ", ".join(f"{k} x{n}" for k, n in sorted(f.kernels.items())) or "-"
    flagged = "; ".join(f.expert_by_token[:3]) or "none"
    return (f"| {_name(c.key)} | ok | {c.compile_s:.1f} | {c.argument_bytes / MIB:,.1f} "
            f"| {c.output_bytes / MIB:,.1f} | {c.temp_bytes / MIB:,.1f} | {kernels} "
            f"| {flagged} |")


def _name(key: StepKey) -> str:
    return f"{key.kind.value}[{key.batch}{',' + str(key.length) if key.length else ''}]"


def main(argv) -> int:
    del argv
    if ROOFLINE.value:
        print(roofline.roofline_table(PRESETS))
        return 0
    name, cfg = model_config()
    pcfg = program_config()
    drafter = drafter_config(name, cfg)
    quantize = QUANTIZE.value
    try:
        devices = gpu_devices(GPU.value, pcfg.tensor_parallel)
    except Exception as e:  # noqa: BLE001 - no plugin: say how to get one
        print(f"error: no compile-only CUDA devices ({type(e).__name__}: {e}); run this in a "
              f"venv with jax's CUDA plugin: pip install -e '.[cuda]' (docs/gpu.md)",
              file=sys.stderr)
        return 2
    print(f"{name} for {GPU.value} ({devices[0].device_kind}, sm_90) x{len(devices)}: "
          f"{pcfg.dtype}, weights {quantize or pcfg.dtype}, K/V {pcfg.page_dtype}, "
          f"speculative {pcfg.speculative} K={pcfg.num_speculative_tokens}, max_concurrency "
          f"{pcfg.max_concurrency}, max_seq_len {pcfg.max_seq_len}, prefill_chunk "
          f"{pcfg.prefill_chunk}, {pcfg.num_pages} pages, {pcfg.num_checkpoint_slots} "
          f"checkpoint slots; jax {jax.__version__}", flush=True)
    print("| executable | status | compile s | argument MiB | output MiB | temp MiB "
          "| Triton kernels | expert x token tensors |\n|---|---|---:|---:|---:|---:|---|---|",
          flush=True)
    params = abstract_params(cfg, pcfg, quantize, drafter)
    start = time.perf_counter()
    results = compile_all(cfg, pcfg, devices, quantize=quantize, drafter=drafter,
                          inspect=inspector(cfg, pcfg, expert_weight_shapes(params)),
                          on_result=lambda c: print(row(c), flush=True))
    wall = time.perf_counter() - start
    problems = [f"{_name(c.key)}: {c.error.splitlines()[0][:200]}" for c in results if not c.ok]
    problems += [f"{_name(c.key)} holds {c.findings.expert_by_token[0]}" for c in results
                 if c.ok and c.findings.expert_by_token]

    reads = []
    for c in results:
        if c.ok and c.key.kind == StepKind.DECODE and c.findings.weights_read is not None:
            # the model counts a plain decode step (a speculative round reads the MTP head
            # or drafter and the lm head more than once: not compared)
            model = (roofline.weight_bytes(cfg, pcfg.dtype, quantize, c.key.batch)
                     if pcfg.speculative == "off" else None)
            reads.append({"executable": _name(c.key), "compiled_bytes": c.findings.weights_read,
                          "copied_bytes": c.findings.weights_copied, "model_bytes": model})
            if model is not None and c.findings.weights_read > model * 1.001 + MIB:
                why = (f" (XLA rematerialized {c.findings.remat} ops to fit the device's "
                       "memory)" if c.findings.remat else "")
                problems.append(f"{_name(c.key)} reads {c.findings.weights_read / 2**30:.3f} "
                                f"GiB of weights, the model {model / 2**30:.3f} GiB{why}")
    if reads:
        print("\nDecode weight bytes read: the compiled step (optimized HLO; 'copied': a slice "
              "written to a buffer of its own before its reader) against the model's count")
        print("| executable | compiled GiB | of it copied GiB | model GiB | ratio |\n"
              "|---|---:|---:|---:|---:|")
        for r in reads:
            model = r["model_bytes"]
            vs = ("- | -" if model is None else
                  f"{model / 2**30:.3f} | {r['compiled_bytes'] / model:.4f}")
            print(f"| {r['executable']} | {r['compiled_bytes'] / 2**30:.3f} "
                  f"| {r['copied_bytes'] / 2**30:.3f} | {vs} |")

    moe_rows = []
    if cfg.variant == "moe":
        b = pcfg.max_concurrency
        for tokens in sorted({MOE_TOKENS.value, b * pcfg.verify_width}):
            moe_rows.append(moe_layer_row(cfg, pcfg, quantize, devices[0], tokens))
        print(f"\nOne MoE layer compiled alone ({pcfg.resolved_layer_loop()} layer loop)")
        print("| tokens | compile s | temp MiB | routed rows' activations MiB | temp / routed "
              "| Triton kernels | expert x token tensors |\n|---:|---:|---:|---:|---:|---|---|")
        for m in moe_rows:
            kernels = ", ".join(f"{k} x{n}" for k, n in sorted(m["triton_kernels"].items()))
            print(f"| {m['tokens']} | {m['compile_s']} | {m['temp_bytes'] / MIB:,.1f} "
                  f"| {m['routed_activation_bytes'] / MIB:,.1f} | {m['temp_over_routed']:.2f} "
                  f"| {kernels} | {'; '.join(m['expert_by_token_tensors'][:2]) or 'none'} |")
            if m["expert_by_token_tensors"]:
                problems.append(f"the MoE layer at {m['tokens']} tokens holds "
                                f"{m['expert_by_token_tensors'][0]}")
            if m["tokens"] == MOE_TOKENS.value and m["temp_over_routed"] > 2:
                problems.append(f"the MoE layer's temp at {m['tokens']} tokens is "
                                f"{m['temp_over_routed']:.2f}x its routed rows' activations")

    ok = [c for c in results if c.ok]
    device_bytes = GPUS[GPU.value]["memory"]
    decode = [c for c in ok if c.key.kind == StepKind.DECODE]
    held = max((c.argument_bytes for c in decode), default=0)  # weights + pools + inputs
    temp = max((c.temp_bytes for c in ok), default=0)
    plan = memory_plan(cfg, pcfg, tensor_parallel=pcfg.tensor_parallel,
                       device_bytes=device_bytes, quantize=quantize)
    total = held + temp
    print(f"\nTotals per device: arguments of the largest decode step {held / 2**30:.2f} GiB "
          f"(weights + pools) + largest temp {temp / 2**30:.2f} GiB = {total / 2**30:.2f} GiB "
          f"of {device_bytes / 2**30:.2f} GiB ({'fits' if total <= device_bytes else 'DOES NOT FIT'}); "
          f"ninfer plan: {plan.device_total / 2**30:.2f} GiB a device. {len(ok)}/{len(results)} "
          f"compiled in {wall:.0f} s.")
    if JSON.value:
        out = {"model": name, "gpu": GPU.value, "program_config": dataclasses.asdict(pcfg),
               "quantize": quantize,
               "executables": [{
                   "name": _name(c.key), "ok": c.ok, "error": c.error,
                   "compile_s": round(c.compile_s, 2), "argument_bytes": c.argument_bytes,
                   "output_bytes": c.output_bytes, "temp_bytes": c.temp_bytes,
                   "triton_kernels": c.findings.kernels if c.ok else {},
                   "expert_by_token_tensors": c.findings.expert_by_token if c.ok else []}
                   for c in results],
               "decode_weight_reads": reads, "moe_layer": moe_rows,
               "total_bytes": total, "device_bytes": device_bytes,
               "plan_device_bytes": plan.device_total, "problems": problems}
        pathlib.Path(JSON.value).write_text(json.dumps(out, indent=1))
    for p in problems:
        print(f"PROBLEM: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    app.run(main)
