"""Worker: XLA's own matrix-vector limit on the weights a decode step reads (the `program` suite).

setup args: path (HF checkpoint dir, loaded with `load_model`). It keeps every weight matrix of
the model (the decoder layers one array each, as the unrolled decode step holds them, and the
embedding that the tied lm head reads) and compiles one jitted chain: for every matrix W [out,
in], y = x W^T with x [1, in] (a fixed random vector plus the previous product's first element,
so that XLA can neither drop, merge nor reorder the products). A repetition runs the chain `steps` times; its work
is `steps`, so its rate is in decode-step-equivalents per second: what a B=1 decode step would
reach if it did nothing but read its weights through XLA:CPU's dot. Ours divided by this rate is
how close the decode step is to its own backend's matrix-vector speed; the copy floor measures
the machine.

Measurement (prepare args): {"kind": "decode", "steps": n} (other fields are ignored).
"""

from __future__ import annotations

import time

from scripts.benchmarks._worker import BenchWorker, serve, timed


class GemvJax(BenchWorker):
    def setup(self, args: dict) -> dict:
        import jax
        import jax.numpy as jnp

        from ninfer_jax.compile_cache import enable_persistent_cache
        from ninfer_jax.loader import load_model
        from ninfer_jax.models.qwen3_6.model import unstack_layers

        enable_persistent_cache()
        start = time.perf_counter()
        model = load_model(args["path"], verify=False)
        params = unstack_layers(model.params, model.config)
        params.pop("mtp", None)  # a decode step does not read the MTP head
        self.mats = [a for a in jax.tree.leaves(params) if a.ndim == 2]
        load_s = time.perf_counter() - start

        @jax.jit
        def chain(mats, x):
            acc = jnp.zeros((), x.dtype)
            for w in mats:
                y = jnp.einsum("bi,oi->bo", x[:, :w.shape[1]] + acc, w)
                acc = y[0, 0] * 1e-6
            return acc

        self.chain = chain
        width = max(a.shape[1] for a in self.mats)
        self.x = jax.random.normal(jax.random.key(0), (1, width), self.mats[0].dtype)
        start = time.perf_counter()
        self.chain(self.mats, self.x).block_until_ready()
        return {"load_s": load_s, "compile_s": time.perf_counter() - start,
                "matrices": len(self.mats),
                "matrix_bytes": int(sum(a.nbytes for a in self.mats))}

    def prepare(self, name: str, args: dict) -> None:
        self.steps = args["steps"]

    def rep(self, name: str) -> dict:
        def run() -> None:
            for _ in range(self.steps):
                self.chain(self.mats, self.x).block_until_ready()

        return timed(run, work=self.steps)


if __name__ == "__main__":
    serve(GemvJax())
