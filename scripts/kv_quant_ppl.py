"""Held-out perplexity of the embedded demo model with INT8 K/V pages against float pages.

    python scripts/kv_quant_ppl.py [--text=tinystories|wikitext] [--windows=32] [--length=512]
                                   [--paths=prefill,decode] [--dtypes=float32,bfloat16]

The CausalScoring purpose never touches the paged pools (a scoring window attends to its own
K/V, `CausalKV`), so `kv_dtype` does not apply there. This script scores teacher-forced text
through the Program's paged K/V instead: `Pools.allocate` for the ProgramConfig (dtype,
kv_dtype) and `PagedKV`, the attention access every Program step uses, over non-overlapping
windows of `--length` + 1 tokens (each from empty state; every token after the first scored):

- path "prefill": the window in `prefill_chunk`-token chunks (64), logits at every position:
  each chunk attends to the pages written so far and to its own K/V (with int8, quantized and
  dequantized as its pages hold them).
- path "decode": one token a step, each attending to all earlier positions in the pages.

Rows per program dtype: the float pages (K/V in that dtype) and int8 pages; "causal" is the
model's plain forward (`CausalKV`, no pages) in that dtype, a check on the paged path. The
relative change of int8 against the float pages of the same run must stay within 0.5% (the
exit status is 1 otherwise). Text: the TinyStories validation head (`--text=tinystories`, the
demo model's domain) or the WikiText-2 test split (`--text=wikitext`), from ../shared/data.
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
DATA = REPO.parent / "shared" / "data"
TEXTS = {"tinystories": DATA / "tinystories" / "valid_head_cased.txt",
         "wikitext": DATA / "wikitext-2-raw" / "wiki.test.raw"}
CHUNK = 64
LIMIT = 0.005  # int8 pages: at most 0.5% above the float pages' perplexity


def windows(text: str, tokenizer, length: int, count: int) -> np.ndarray:
    """`count` non-overlapping windows of length + 1 token ids, evenly spread over the text."""
    ids = np.asarray(tokenizer.encode(text), np.int32)
    n = len(ids) // (length + 1)
    if n < count:
        raise SystemExit(f"the text has {len(ids)} tokens: {n} windows of {length + 1}, "
                         f"fewer than --windows={count}")
    picks = np.linspace(0, n - 1, count).round().astype(int)
    return np.stack([ids[i * (length + 1):(i + 1) * (length + 1)] for i in picks])


@functools.cache
def paged_scorer(cfg, dtype: str, kv_dtype: str, path: str, length: int):
    """A jitted (params, window [length + 1]) -> summed NLL of its last `length` tokens through
    PagedKV over fresh pools of this ProgramConfig."""
    from ninfer_jax.models.qwen3_6 import GDNState, step
    from ninfer_jax.program.config import ProgramConfig
    from ninfer_jax.program.pools import PagedKV, Pools

    pcfg = ProgramConfig(max_concurrency=1, page_size=16, num_pages=-(-length // 16),
                         max_seq_len=length, prefill_chunk=CHUNK, dtype=dtype,
                         kv_dtype=kv_dtype, attention_impl="reference", gdn_impl="reference",
                         num_checkpoint_slots=0, max_vision_patches=0)
    t = CHUNK if path == "prefill" else 1
    if length % t:
        raise SystemExit(f"--length must be a multiple of {CHUNK}, got {length}")

    @jax.jit
    def score(params, window):
        kv_layers = Pools.allocate(cfg, pcfg).kv
        tables = jnp.arange(pcfg.max_pages_per_seq, dtype=jnp.int32)[None]
        gdn = GDNState.zeros(cfg, 1, jnp.dtype(dtype))

        def one(carry, start):
            kv_layers, gdn = carry
            ids = jax.lax.dynamic_slice(window, (start,), (t,))[None]
            targets = jax.lax.dynamic_slice(window, (start + 1,), (t,))
            kv = PagedKV(layers=kv_layers, page_tables=tables, lengths=start[None],
                         num_valid=jnp.full((1,), t, jnp.int32), impl="reference",
                         pages_per_layer=pcfg.num_pages + 1)
            out = step(params, cfg, ids, start[None], gdn, kv, jnp.full((1,), t, jnp.int32))
            logp = jax.nn.log_softmax(out.logits[0].astype(jnp.float32), axis=-1)
            nll = -jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
            return (out.kv.layers, out.gdn), nll.sum()

        starts = jnp.arange(0, length, t, dtype=jnp.int32)
        _, nll = jax.lax.scan(one, (kv_layers, gdn), starts)
        return nll.sum()

    return score


@functools.cache
def causal_scorer(cfg, length: int):
    from ninfer_jax.models.qwen3_6 import forward

    @jax.jit
    def score(params, window):
        logits = forward(params, cfg, window[None, :length])[0].astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, window[1:, None], axis=-1).sum()

    return score


def perplexity(score, params, data: np.ndarray) -> tuple[float, float]:
    """(perplexity, seconds) over every window."""
    start = time.perf_counter()
    total = sum(float(score(params, jnp.asarray(w))) for w in data)
    return math.exp(total / (data.shape[0] * (data.shape[1] - 1))), time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--text", choices=sorted(TEXTS), default="tinystories")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--paths", default="prefill,decode")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    args = ap.parse_args(argv)

    from ninfer_jax.frontend import load_tokenizer
    from ninfer_jax.loader import load_model

    demo = load_model()
    cfg = demo.config
    data = windows(TEXTS[args.text].read_text(encoding="utf-8"), load_tokenizer(demo.path),
                   args.length, args.windows)
    print(f"demo model, {args.text}: {args.windows} windows of {args.length} scored tokens "
          f"({data.shape[0] * args.length} in all)", flush=True)
    rows, failed = [], False
    for dtype in args.dtypes.split(","):
        params = jax.tree.map(functools.partial(jnp.asarray, dtype=dtype), demo.params)
        causal, secs = perplexity(causal_scorer(cfg, args.length), params, data)
        rows.append((dtype, "causal", "none (CausalKV)", causal, None, secs))
        for path in args.paths.split(","):
            base = None
            for kv in ("auto", "int8"):
                ppl, secs = perplexity(paged_scorer(cfg, dtype, kv, path, args.length), params,
                                       data)
                pages = dtype if kv == "auto" else "int8"
                change = None if base is None else ppl / base - 1
                base = ppl if base is None else base
                failed |= change is not None and change > LIMIT
                rows.append((dtype, path, pages, ppl, change, secs))
                print(f"  {dtype} {path} {pages}: {ppl:.4f} ({secs:.0f} s)", flush=True)
    print()
    print("| dtype | path | K/V pages | perplexity | vs float pages | seconds |")
    print("|---|---|---|---:|---:|---:|")
    for dtype, path, pages, ppl, change, secs in rows:
        vs = "" if change is None else f"{100 * change:+.3f}%"
        print(f"| {dtype} | {path} | {pages} | {ppl:.4f} | {vs} | {secs:.0f} |")
    if failed:
        print(f"FAIL: int8 pages more than {100 * LIMIT:.1f}% above float pages", file=sys.stderr)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
