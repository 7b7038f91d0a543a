"""Scoring throughput: CausalScoreCore next to transformers forward + log_softmax, same windows.

    python scripts/bench.py --suite=scoring --out=DIR

For the tiny test config and `configs.models.MEDIUM` (random fp32 weights), in one process:

- the job: `num_windows` sequences of `window` + 1 random tokens; each is one window that reads
  `window` tokens and scores `window` next tokens; `rows` windows per call.
- ours: `CausalScoreCore` with window = `window` and max_batch_tokens = `rows * window` (one
  compiled shape); scored tokens/s = targets / time, median of `reps` runs after a warm-up run.
- transformers: the same weights exported with `ninfer_jax.artifact.export.export_hf` and loaded
  with `Qwen3_5ForCausalLM.from_pretrained(dtype=float32)`; per call of `rows` windows:
  `log_softmax(model(ids).logits)` gathered at the targets and `argmax == target` (what
  lm-evaluation-harness's HF backend does), under `torch.no_grad()`; median of `hf_reps` runs
  after a warm-up call.

Both sides' per-token log-probs are compared (max error relative to the largest |log-prob|) and
their greedy flags counted, so the table is about the same numbers. Load averages are recorded:
on a shared machine the ratio (same run, same load) is the meaningful figure.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

import jax
import numpy as np

from configs.models import MEDIUM
from ninfer_jax.compile_cache import enable_persistent_cache
from ninfer_jax.models.qwen3_6 import ModelConfig
from ninfer_jax.models.qwen3_6.weights import init_params
from ninfer_jax.scoring import CausalScoreCore, ScoreRequest, ScoringConfig
from ninfer_jax.testing import tiny_dense
from scripts.benchmarks._timing import median_seconds


@dataclasses.dataclass(frozen=True)
class Settings:
    window: int = 256
    num_windows: int = 4
    rows: int = 2
    reps: int = 3
    hf_reps: int = 1


FULL_RUN = Settings()


def _job(cfg: ModelConfig, s: Settings, seed: int) -> list[np.ndarray]:
    """One sequence per window: W inputs and the token after them (W targets, from index 1)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, cfg.vocab_size, s.window + 1) for _ in range(s.num_windows)]


def ours(cfg: ModelConfig, params: dict, seqs: list[np.ndarray], s: Settings) -> dict:
    start = time.perf_counter()
    core = CausalScoreCore(cfg, params, ScoringConfig(window=s.window, min_len=s.window,
                                                      max_batch_tokens=s.rows * s.window))
    compile_s = time.perf_counter() - start
    requests = [ScoreRequest(q, 1) for q in seqs]
    results = core.score(requests)  # warm-up
    seconds = median_seconds(lambda: core.score(requests), s.reps)
    return {"tokens_per_s": sum(len(q) - 1 for q in seqs) / seconds, "compile_s": compile_s,
            "logprobs": np.stack([r.logprobs for r in results]),
            "is_greedy": np.stack([r.is_greedy for r in results])}


def transformers(cfg: ModelConfig, params: dict, seqs: list[np.ndarray], s: Settings) -> dict:
    import torch
    from transformers import Qwen3_5ForCausalLM

    from ninfer_jax.artifact.export import export_hf

    with tempfile.TemporaryDirectory() as tmp:
        export_hf(cfg, params, tmp)
        model = Qwen3_5ForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    batches = [torch.from_numpy(np.stack(seqs[i : i + s.rows]).astype(np.int64))
               for i in range(0, len(seqs), s.rows)]

    def score(batch):
        logits = model(batch[:, :-1]).logits.float()
        lp = torch.log_softmax(logits, dim=-1)
        targets = batch[:, 1:]
        return (torch.gather(lp, -1, targets[..., None])[..., 0],
                logits.argmax(-1) == targets)

    with torch.no_grad():
        score(batches[0])  # warm-up
        seconds = median_seconds(lambda: [score(b) for b in batches], s.hf_reps)
        out = [score(b) for b in batches]
    return {"tokens_per_s": sum(len(q) - 1 for q in seqs) / seconds,
            "logprobs": torch.cat([o[0] for o in out]).numpy(),
            "is_greedy": torch.cat([o[1] for o in out]).numpy()}


def measure(name: str, cfg: ModelConfig, s: Settings, seed: int = 0) -> dict:
    params = init_params(cfg, jax.random.key(seed))
    seqs = _job(cfg, s, seed)
    load = {"start": os.getloadavg()[0]}
    ours_r = ours(cfg, params, seqs, s)
    load["after_ours"] = os.getloadavg()[0]
    hf_r = transformers(cfg, params, seqs, s)
    load["after_transformers"] = os.getloadavg()[0]
    diff = np.abs(ours_r["logprobs"] - hf_r["logprobs"]).max()
    return {
        "config": name, "num_params": sum(a.size for a in jax.tree.leaves(params)),
        "window": s.window, "num_windows": s.num_windows, "rows_per_call": s.rows,
        "ours_tokens_per_s": ours_r["tokens_per_s"], "ours_compile_s": ours_r["compile_s"],
        "transformers_tokens_per_s": hf_r["tokens_per_s"],
        "ours_over_transformers": ours_r["tokens_per_s"] / hf_r["tokens_per_s"],
        "logprob_rel_err": float(diff / np.abs(hf_r["logprobs"]).max()),
        "greedy_flags_agree": float((ours_r["is_greedy"] == hf_r["is_greedy"]).mean()),
        "load_average_1min": load,
    }


def format_table(results: list[dict]) -> str:
    lines = [f"{'config':<8}{'params':>9}{'windows':>14}{'ours tok/s':>12}{'hf tok/s':>10}"
             f"{'ours/hf':>9}{'logprob rel err':>17}{'greedy agree':>14}"]
    for r in results:
        windows = f"{r['num_windows']}x{r['window']} (B={r['rows_per_call']})"
        lines.append(
            f"{r['config']:<8}{r['num_params'] / 1e6:>8.1f}M{windows:>14}"
            f"{r['ours_tokens_per_s']:>12.1f}{r['transformers_tokens_per_s']:>10.1f}"
            f"{r['ours_over_transformers']:>9.2f}{r['logprob_rel_err']:>17.1e}"
            f"{r['greedy_flags_agree']:>14.3f}")
    return "\n".join(lines)


def run(out_dir: str, s: Settings = FULL_RUN) -> dict:
    del out_dir  # the table is the result; bench.py writes the JSON
    enable_persistent_cache()
    start = time.perf_counter()
    tiny = dataclasses.replace(s, num_windows=4 * s.num_windows, reps=max(s.reps, 5), hf_reps=3)
    results = [measure("tiny", tiny_dense(), tiny), measure("medium", MEDIUM, s)]
    table = format_table(results)
    print(table)
    return {"settings": dataclasses.asdict(s), "results": results, "cpu_count": os.cpu_count(),
            "wall_s": time.perf_counter() - start, "table": table}
