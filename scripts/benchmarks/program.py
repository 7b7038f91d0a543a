"""Program decode and prefill throughput next to transformers and the memory-bandwidth floor.

    python scripts/bench.py --suite=program --out=DIR

For the tiny test config and `configs.models.MEDIUM` (random fp32 weights), in one process:

- ours, decode: a Program with exact-B executables; B sequences with a 32-token prompt, then
  decode+commit rounds. Aggregate tokens/s = B * steps / time, median of `reps` repetitions of
  DECODE_STEPS rounds after one warm-up repetition, for B in BATCHES.
- ours, prefill: a 512-token prompt through staged prefill (to the first sampled token) for each
  chunk size in PREFILL_CHUNKS (a Program per chunk size); the best chunk size is reported.
- transformers: the same weights written as an HF checkpoint (config.json + model.safetensors)
  and loaded with `Qwen3_5ForCausalLM.from_pretrained(dtype=float32)`. Decode tokens/s from
  greedy `generate` of steps + 1 tokens on the same prompts, timed per token by a stopping
  criterion that never stops: B * steps / (time of the last token - time of the first), so the
  prompt's prefill is excluded. Prefill tokens/s: one forward over the same 512-token prompt.
- floor: decode step time >= weight bytes read per step / copy bandwidth, the bandwidth measured
  here (bytes read + written by a 1 GiB copy; the faster of numpy's single-threaded copy and
  torch's multi-threaded one).

As a check that both engines run the same model, ours and transformers' greedy tokens for the
B=1 decode prompt are compared. The machine load average is recorded around every measurement:
on a shared machine the ratios (same run, same load) are the meaningful numbers.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import tempfile
import time

import jax
import numpy as np

from configs.models import MEDIUM
from ninfer_jax.artifact.export import export_hf
from ninfer_jax.compile_cache import enable_persistent_cache
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.models.qwen3_6.weights import init_params
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.program import Program
from ninfer_jax.testing import tiny_dense
from scripts.benchmarks._timing import median_seconds


@dataclasses.dataclass(frozen=True)
class Settings:
    batches: tuple[int, ...] = (1, 2, 4, 8)
    decode_steps: int = 16
    reps: int = 3
    decode_prompt_len: int = 32
    prefill_len: int = 512
    prefill_chunks: tuple[int, ...] = (64, 128, 256)
    prefill_reps: int = 3
    page_size: int = 16


FULL_RUN = Settings()
COPY_BYTES = 1 << 30


def copy_bandwidth(nbytes: int = COPY_BYTES, reps: int = 5) -> dict[str, float]:
    """GB/s of bytes read + written by a large copy, numpy (1 thread) and torch (all threads)."""
    import torch

    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    numpy_gbps = 2 * nbytes / median_seconds(lambda: np.copyto(dst, src), reps) / 1e9
    tsrc, tdst = torch.from_numpy(src), torch.from_numpy(dst)
    tdst.copy_(tsrc)
    torch_gbps = 2 * nbytes / median_seconds(lambda: tdst.copy_(tsrc), reps) / 1e9
    return {"numpy_gbps": numpy_gbps, "torch_gbps": torch_gbps,
            "gbps": max(numpy_gbps, torch_gbps)}


def decode_weight_bytes(cfg: ModelConfig, params: dict) -> int:
    """Bytes of weights one decode step must read: all of them, but only a row of an untied
    embedding table."""
    total = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))
    if not cfg.tie_word_embeddings:
        total -= params["embed"].size * params["embed"].dtype.itemsize
    return total


# Ours ---------------------------------------------------------------------------------------
def _admit(prog: Program, prompt: np.ndarray, max_new: int):
    return prog.materialize(prog.plan_admission(len(prompt), max_new), prompt.tolist())


def _prefill(prog: Program, handle) -> None:
    while (pb := prog.prefill(handle)) is None:
        pass
    prog.commit(pb, [1])


def _prefill_once(prog: Program, prompt: np.ndarray) -> None:
    handle = _admit(prog, prompt, 1)
    _prefill(prog, handle)
    prog.release(handle)


def _decode_rounds(prog: Program, handles: list, steps: int) -> None:
    for _ in range(steps):
        prog.commit(prog.decode(handles), [1] * len(handles))


def ours_decode(cfg: ModelConfig, params: dict, prompts: np.ndarray, s: Settings) -> dict:
    """Aggregate decode tokens/s per B and B=1's greedy tokens (prompts [max B, T])."""
    max_new = 1 + s.decode_steps * (s.reps + 1)
    per_seq = -(-(s.decode_prompt_len + max_new) // s.page_size)
    pcfg = ProgramConfig(max_concurrency=max(s.batches), page_size=s.page_size,
                         num_pages=per_seq * max(s.batches),
                         max_seq_len=per_seq * s.page_size, prefill_chunk=s.decode_prompt_len)
    start = time.perf_counter()
    prog = Program(cfg, params, pcfg)
    compile_s = time.perf_counter() - start
    tps, tokens = {}, None
    for b in s.batches:
        handles = [_admit(prog, prompts[r], max_new) for r in range(b)]
        for h in handles:
            _prefill(prog, h)
        rounds = functools.partial(_decode_rounds, prog, handles, s.decode_steps)
        rounds()  # warm-up
        tps[b] = b * s.decode_steps / median_seconds(rounds, s.reps)
        if b == 1:
            tokens = prog.tokens(handles[0])[s.decode_prompt_len:][: s.decode_steps + 1]
        for h in handles:
            prog.release(h)
    return {"tokens_per_s": tps, "greedy_tokens": tokens, "compile_s": compile_s}


def ours_prefill(cfg: ModelConfig, params: dict, prompt: np.ndarray, s: Settings) -> dict:
    """Prefill tokens/s of one prompt for each chunk size (to the first sampled token)."""
    n = len(prompt)
    per_seq = -(-(n + 1) // s.page_size)
    tps, compile_s = {}, {}
    for chunk in s.prefill_chunks:
        pcfg = ProgramConfig(max_concurrency=1, page_size=s.page_size, num_pages=per_seq,
                             max_seq_len=per_seq * s.page_size, prefill_chunk=chunk)
        start = time.perf_counter()
        prog = Program(cfg, params, pcfg)
        compile_s[chunk] = time.perf_counter() - start
        once = functools.partial(_prefill_once, prog, prompt)
        once()  # warm-up
        tps[chunk] = n / median_seconds(once, s.prefill_reps)
    best = max(tps, key=tps.get)
    return {"tokens_per_s": tps, "best_chunk": best, "best_tokens_per_s": tps[best],
            "compile_s": compile_s}


# Transformers -------------------------------------------------------------------------------
def hf_decode_and_prefill(model, prompts: np.ndarray, prefill_prompt: np.ndarray,
                          s: Settings) -> dict:
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepClock(StoppingCriteria):
        """Timestamps every generated token (called after each one); never stops generation."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    def decode_seconds(ids) -> tuple[float, list[int]]:
        """Seconds for tokens 2..steps+1 of one greedy generate (the prefill and first token
        excluded), and row 0's tokens."""
        clock = StepClock()
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=s.decode_steps + 1, min_new_tokens=s.decode_steps + 1,
                             do_sample=False, pad_token_id=0, eos_token_id=None,
                             stopping_criteria=StoppingCriteriaList([clock]))
        assert len(clock.times) == s.decode_steps + 1
        return clock.times[-1] - clock.times[0], out[0, s.decode_prompt_len:].tolist()

    tps, tokens = {}, None
    with torch.no_grad():
        for b in s.batches:
            ids = torch.from_numpy(prompts[:b].astype(np.int64))
            decode_seconds(ids)  # warm-up
            runs = [decode_seconds(ids) for _ in range(s.reps)]
            tps[b] = b * s.decode_steps / statistics.median(t for t, _ in runs)
            if b == 1:
                tokens = runs[0][1]
        ids = torch.from_numpy(prefill_prompt[None].astype(np.int64))
        model(ids)  # warm-up
        prefill = len(prefill_prompt) / median_seconds(lambda: model(ids), s.prefill_reps)
    return {"decode_tokens_per_s": tps, "prefill_tokens_per_s": prefill, "greedy_tokens": tokens}


def _load_hf(cfg: ModelConfig, params: dict, path: str):
    import torch
    from transformers import Qwen3_5ForCausalLM

    export_hf(cfg, jax.tree.map(np.asarray, params), path)
    return Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# The suite ----------------------------------------------------------------------------------
def _progress(what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {what}", flush=True)


def measure(name: str, cfg: ModelConfig, s: Settings, bandwidth_gbps: float,
            seed: int = 0) -> dict:
    """Every number of one config: ours, transformers, floor, ratios, and the load averages."""
    params = init_params(cfg, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, cfg.vocab_size, (max(s.batches), s.decode_prompt_len))
    prefill_prompt = rng.integers(0, cfg.vocab_size, s.prefill_len)
    load = {"start": os.getloadavg()[0]}
    _progress(f"{name}: ours, decode")
    decode = ours_decode(cfg, params, prompts, s)
    load["after_ours_decode"] = os.getloadavg()[0]
    _progress(f"{name}: ours, prefill")
    prefill = ours_prefill(cfg, params, prefill_prompt, s)
    load["after_ours_prefill"] = os.getloadavg()[0]
    _progress(f"{name}: transformers")
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_decode_and_prefill(_load_hf(cfg, params, tmp), prompts, prefill_prompt, s)
    load["after_transformers"] = os.getloadavg()[0]
    weight_bytes = decode_weight_bytes(cfg, params)
    floor_tps = bandwidth_gbps * 1e9 / weight_bytes
    ours_tps, hf_tps = decode["tokens_per_s"], hf["decode_tokens_per_s"]
    b_lo, b_hi = min(s.batches), max(s.batches)
    agree = 0
    for a, b in zip(decode["greedy_tokens"], hf["greedy_tokens"]):
        if a != b:
            break
        agree += 1
    return {
        "config": name,
        "num_params": sum(a.size for a in jax.tree.leaves(params)),
        "weight_bytes_per_decode_step": weight_bytes,
        "ours": {"decode_tokens_per_s": ours_tps, "prefill": prefill,
                 "decode_compile_s": decode["compile_s"]},
        "transformers": {"decode_tokens_per_s": hf_tps,
                         "prefill_tokens_per_s": hf["prefill_tokens_per_s"]},
        "floor_decode_tokens_per_s_b1": floor_tps,
        "ratios": {
            "decode_ours_over_transformers": {b: ours_tps[b] / hf_tps[b] for b in s.batches},
            "decode_b1_ours_over_floor": ours_tps[b_lo] / floor_tps,
            "decode_scaling_ours": ours_tps[b_hi] / ours_tps[b_lo],
            "decode_scaling_transformers": hf_tps[b_hi] / hf_tps[b_lo],
            "prefill_ours_over_transformers":
                prefill["best_tokens_per_s"] / hf["prefill_tokens_per_s"],
        },
        "greedy_prefix_agreement": f"{agree}/{len(decode['greedy_tokens'])}",
        "load_average_1min": load,
    }


def format_table(results: list[dict], bandwidth: dict) -> str:
    lines = [(f"copy bandwidth (read+write): numpy {bandwidth['numpy_gbps']:.2f} GB/s, "
              f"torch {bandwidth['torch_gbps']:.2f} GB/s; floor uses {bandwidth['gbps']:.2f}")]
    for r in results:
        o, t, q = r["ours"], r["transformers"], r["ratios"]
        lines += [
            "",
            (f"{r['config']}: {r['num_params'] / 1e6:.1f}M params, "
             f"{r['weight_bytes_per_decode_step'] / 1e6:.0f} MB/step, greedy tokens agree "
             f"{r['greedy_prefix_agreement']}, load avg {r['load_average_1min']}"),
            f"  {'decode B':<10}{'ours tok/s':>12}{'hf tok/s':>12}{'ours/hf':>10}",
        ]
        for b, v in o["decode_tokens_per_s"].items():
            lines.append(f"  {b:<10}{v:>12.1f}{t['decode_tokens_per_s'][b]:>12.1f}"
                         f"{q['decode_ours_over_transformers'][b]:>10.2f}")
        p = o["prefill"]
        chunks = ", ".join(f"{c}: {v:.0f}" for c, v in p["tokens_per_s"].items())
        lines += [
            (f"  floor B=1 {r['floor_decode_tokens_per_s_b1']:.1f} tok/s; "
             f"ours/floor {q['decode_b1_ours_over_floor']:.2f}"),
            (f"  B={max(o['decode_tokens_per_s'])} / B=1 aggregate: ours "
             f"{q['decode_scaling_ours']:.2f}x, hf {q['decode_scaling_transformers']:.2f}x"),
            (f"  prefill tok/s: ours {p['best_tokens_per_s']:.1f} (chunk {p['best_chunk']}; "
             f"{chunks}), hf {t['prefill_tokens_per_s']:.1f}, ours/hf "
             f"{q['prefill_ours_over_transformers']:.2f}"),
        ]
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2 * len(results), figsize=(5 * 2 * len(results), 4))
    for i, r in enumerate(results):
        ax = axes[2 * i]
        ours, hf = r["ours"]["decode_tokens_per_s"], r["transformers"]["decode_tokens_per_s"]
        ax.plot(list(ours), list(ours.values()), "o-", label="ours")
        ax.plot(list(hf), list(hf.values()), "s-", label="transformers")
        ax.plot(list(ours), [b * r["floor_decode_tokens_per_s_b1"] for b in ours], "k--",
                label="bandwidth floor x B")
        ax.set(title=f"{r['config']}: decode", xlabel="B", ylabel="aggregate tokens/s",
               xscale="log", yscale="log", xticks=list(ours))
        ax.set_xticklabels([str(b) for b in ours])
        ax.legend()
        ax = axes[2 * i + 1]
        p = r["ours"]["prefill"]["tokens_per_s"]
        names = [f"ours c={c}" for c in p] + ["transformers"]
        ax.bar(names, list(p.values()) + [r["transformers"]["prefill_tokens_per_s"]])
        ax.set(title=f"{r['config']}: prefill of 512 tokens", ylabel="tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(out_dir: str, s: Settings = FULL_RUN) -> dict:
    enable_persistent_cache()
    start = time.perf_counter()
    load_start = os.getloadavg()
    bandwidth = copy_bandwidth()
    results = [measure("tiny", tiny_dense(), s, bandwidth["gbps"]),
               measure("medium", MEDIUM, s, bandwidth["gbps"])]
    table = format_table(results, bandwidth)
    print(table)
    plot(results, os.path.join(out_dir, "program.png"))
    return {"settings": dataclasses.asdict(s), "bandwidth": bandwidth, "results": results,
            "load_average_start": load_start, "load_average_end": os.getloadavg(),
            "cpu_count": os.cpu_count(), "wall_s": time.perf_counter() - start, "table": table}
