"""Where a DFlash round's time goes on the embedded model: ms per decode round at B = 1.

    python scripts/profile_dflash_round.py [--k=4] [--reps=7]

One Program at max_concurrency 1 per variant, built in turn in this process (each freed before
the next), each generating 128 tokens greedily from the first story prompt `reps` times; the
median ms per round of all but the first generation is printed with the tokens a round
committed. Variants: no speculation ("off"), MTP K = 2 ("mtp"), DFlash with each head
("full", "selector"), and two ablations that change the output and are for timing only:
"argmax" (drafts are the proposal's argmax, no per-position transform) and "no_block" (the
drafter's block forward replaced by zeros, the selector kept). See docs/speculative.md,
"DFlash"; the run of 2026-12-02 is results/profile_dflash_round_2026-12-02.json.
"""

from __future__ import annotations

import gc
import pathlib
import statistics
import sys

import jax
import jax.numpy as jnp
from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from ninfer_jax.compile_cache import enable_persistent_cache
from ninfer_jax.frontend import Frontend
from ninfer_jax.loader import DEFAULT_DRAFTER, load_drafter, load_model
from ninfer_jax.program import dflash_steps
from scripts.benchmarks._engine_vs_program import PROMPTS
from scripts.benchmarks._spec_sides import GenerateSide, build_program, program_config

FLAGS = flags.FLAGS
flags.DEFINE_integer("k", 4, "DFlash drafts per round", lower_bound=1, upper_bound=15)
flags.DEFINE_integer("reps", 7, "generations per variant (the first is not counted)",
                     lower_bound=2)

VARIANTS = ("off", "mtp", "full", "selector", "argmax", "no_block")


def _argmax_drafts(dparams, drafter, hidden, logits, anchor, arrays, step_index, vocab_size):
    drafts = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return drafts, jax.nn.one_hot(drafts, vocab_size, dtype=jnp.float32)


def _measure(variant: str, loaded, drafter, prompt: list[int]) -> tuple[float, float]:
    saved = dflash_steps._select_drafts, dflash_steps.block_hidden
    head, method, k = "full", "dflash", FLAGS.k
    if variant in ("off", "mtp"):
        method, k = "mtp", 0 if variant == "off" else 2
    elif variant in ("selector", "no_block"):
        head = "selector"
    if variant == "argmax":  # the selector's place, so the full head's transforms are skipped
        head, dflash_steps._select_drafts = "selector", _argmax_drafts
    if variant == "no_block":
        hidden_size = loaded.config.hidden_size
        dflash_steps.block_hidden = lambda p, d, embeds, *a: jnp.zeros(
            (*embeds.shape[:2], hidden_size), embeds.dtype)
    try:
        pcfg = program_config(k, 1, len(prompt) + 130, prefill_chunk=64, method=method,
                              draft_head=head)
        program, _ = build_program(loaded.config, loaded.params, pcfg,
                                   drafter if method == "dflash" and k else None)
    finally:
        dflash_steps._select_drafts, dflash_steps.block_hidden = saved
    side = GenerateSide(program, k, 128)
    side.prepare(variant, {"prompts": [prompt]})
    ms, per_round = [], 0.0
    for _ in range(FLAGS.reps):
        r = side.rep(variant)
        rounds = r["outputs"]["tally"]["row_rounds"]
        ms.append(1000 * r["seconds"] / rounds)
        per_round = r["outputs"]["tally"]["committed"] / rounds
    del side, program
    gc.collect()
    jax.clear_caches()
    return statistics.median(ms[1:]), per_round


def main(argv):
    del argv
    enable_persistent_cache()
    loaded = load_model(None, verify=False)
    drafter = load_drafter(DEFAULT_DRAFTER)
    prompt = list(Frontend.load(loaded.path).prepare(prompt=PROMPTS[0]).token_ids)
    print(f"B=1, DFlash K={FLAGS.k}, MTP K=2; median of {FLAGS.reps - 1} generations")
    print(f"{'variant':>10}{'ms/round':>10}{'tok/round':>11}")
    for variant in VARIANTS:
        ms, per_round = _measure(variant, loaded, drafter, prompt)
        print(f"{variant:>10}{ms:>10.2f}{per_round:>11.2f}", flush=True)


if __name__ == "__main__":
    app.run(main)
