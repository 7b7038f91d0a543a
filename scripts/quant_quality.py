"""Quality of quantized weights on the embedded demo model: held-out perplexity with fp32,
int8 and int4 weights (group-wise 128, weight-only; `ninfer_jax.quant`), and greedy
continuations side by side.

    python scripts/quant_quality.py [--chars=100000] [--window=512]

Perplexity: the causal-scoring path (`Scorer`, rolling windows of --window tokens, stride half a
window) over the first --chars characters of TinyStories' validation text
(../shared/data/tinystories/valid_head_cased.txt), which the demo was not trained on. Each
quantized run loads the model with `quantize=` (what `ninfer convert --quantize` writes; the
tests check the two are the same weights). Limits the issue sets: int8 within 1%, int4
within 5% of fp32.
"""

from __future__ import annotations

import pathlib
import sys
import time

from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from ninfer_jax import Engine, SamplingParams
from ninfer_jax.scoring.scorer import Scorer

DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "tinystories"
PROMPTS = ("Once upon a time, there was a little", "Tom and his mom went to the park. Tom saw",
           "The sun was hot and the flowers were")
LIMITS = {"int8": 0.01, "int4": 0.05}

flags.DEFINE_integer("chars", 100_000, "held-out characters scored", lower_bound=1000)
flags.DEFINE_integer("window", 512, "rolling window (tokens)", lower_bound=64)
flags.DEFINE_integer("max_new_tokens", 32, "greedy tokens per prompt", lower_bound=1)
FLAGS = flags.FLAGS


def main(_argv) -> int:
    text = (DATA / "valid_head_cased.txt").read_text()[: FLAGS.chars]
    ppl, greedy = {}, {}
    for method in (None, "int8", "int4"):
        start = time.perf_counter()
        scorer = Scorer.open(None, quantize=method, window=FLAGS.window,
                             stride=FLAGS.window // 2)
        ppl[method] = scorer.perplexity(text)
        with Engine.open(None, quantize=method, max_concurrency=len(PROMPTS)) as engine:
            sampling = SamplingParams(temperature=0.0, max_new_tokens=FLAGS.max_new_tokens)
            handles = [engine.submit(p, sampling=sampling) for p in PROMPTS]
            greedy[method] = [h.result().text for h in handles]
        print(f"{method or 'fp32'}: perplexity {ppl[method]:.4f} "
              f"({time.perf_counter() - start:.0f}s)", file=sys.stderr)
    tokens = len(scorer._tokenizer().encode(text))
    print(f"held-out perplexity, {tokens} tokens of TinyStories validation, window "
          f"{FLAGS.window}, stride {FLAGS.window // 2}")
    print("| weights | perplexity | vs fp32 | limit | holds |")
    print("|---|---|---|---|---|")
    ok = True
    for method, value in ppl.items():
        rel = value / ppl[None] - 1
        limit = LIMITS.get(method)
        holds = limit is None or abs(rel) <= limit
        ok &= holds
        print(f"| {method or 'fp32'} | {value:.4f} | {rel:+.3%} | "
              f"{'-' if limit is None else f'{limit:.0%}'} | {'yes' if holds else 'NO'} |")
    print("\ngreedy continuations (temperature 0):")
    for i, prompt in enumerate(PROMPTS):
        print(f"\nprompt: {prompt!r}")
        for method in greedy:
            same = "" if method is None else (
                "  (= fp32)" if greedy[method][i] == greedy[None][i] else "")
            print(f"  {method or 'fp32':>5}: {greedy[method][i]!r}{same}")
    return 0 if ok else 1


if __name__ == "__main__":
    app.run(main)
