"""The matmul floor of scoring a model on this machine: every weight matrix of the decoder
stack and the (tied) head applied to TOKENS tokens in one jitted chain of XLA dots, nothing
else: the matmul work a scoring call cannot avoid, timed as plain dots. It is a yardstick, not
a strict bound: the MEDIUM rolling call ran at 1.02 of it on 2026-12-05 (a fused call's dots can
run faster than the chain's, each of which writes its output and sums it).
`scripts/bench.py --suite=scoring` measures the real path (and this chain, in the same turns, on
its rolling task).

    python -m scripts.scoring_matmul_floor [medium|tiny|demo] [TOKENS]
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from scripts.benchmarks._checkpoint import model_config


def matmul_chain(params: dict, tokens: int):
    """(fn, args, MACs a token): fn(*args) applies every weight matrix of the stack (one per
    layer, at least 64 x 64) and the head to `tokens` rows of ones, one dot after another."""
    weights = [leaf[i] for part in ("linear", "attention") for leaf in jax.tree.leaves(params[part])
               if leaf.ndim == 3 and min(leaf.shape[1:]) >= 64 for i in range(leaf.shape[0])]
    head = params.get("lm_head", params["embed"])

    @jax.jit
    def chain(weights, head):
        total = jnp.sum(jnp.ones((tokens, head.shape[1])) @ head.T)
        for w in weights:
            total = total + jnp.sum(jnp.ones((tokens, w.shape[0])) @ w)
        return total

    return chain, (weights, head), sum(w.size for w in weights) + head.size


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else "medium"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    if name == "demo":  # the embedded model
        from ninfer_jax.loader import load_model

        params = load_model(None, dtype="float32").params
    else:
        from ninfer_jax.models.qwen3_6.weights import init_params

        params = init_params(model_config(name), jax.random.key(0))
    chain, args, macs = matmul_chain(params, tokens)
    chain(*args).block_until_ready()
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        chain(*args).block_until_ready()
        seconds.append(time.perf_counter() - start)
    s = float(np.median(seconds))
    print(f"{name}: {macs / 1e6:.0f}M MACs a token; {tokens} tokens in {s:.2f} s (median of 3) "
          f"-> {tokens / s:.0f} tok/s, {2 * macs * tokens / s / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
