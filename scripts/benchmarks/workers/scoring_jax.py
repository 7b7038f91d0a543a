"""Worker: our CausalScoreCore on a model directory (the `scoring` suite).

setup args: path (HF checkpoint dir, loaded with `load_model`), window, rows. One compiled
window shape: window = min_len = `window`, max_batch_tokens = rows * window.
Measurement (prepare args {"seqs": [[window + 1 ids], ...]}): a repetition scores every
sequence as one window (targets from index 1); outputs the log-probs and greedy flags,
[num_seqs][window] each.
"""

from __future__ import annotations

import time

from scripts.benchmarks._worker import BenchWorker, serve, timed


class ScoringJax(BenchWorker):
    def setup(self, args: dict) -> dict:
        import jax

        from ninfer_jax.compile_cache import enable_persistent_cache
        from ninfer_jax.loader import load_model
        from ninfer_jax.scoring import CausalScoreCore, ScoringConfig

        enable_persistent_cache()
        start = time.perf_counter()
        model = load_model(args["path"], verify=False)
        load_s = time.perf_counter() - start
        w = args["window"]
        start = time.perf_counter()
        self.core = CausalScoreCore(model.config, model.params, ScoringConfig(
            window=w, min_len=w, max_batch_tokens=args["rows"] * w))
        return {"load_s": load_s, "compile_s": time.perf_counter() - start,
                "jax": jax.__version__}

    def prepare(self, name: str, args: dict) -> None:
        import numpy as np

        from ninfer_jax.scoring import ScoreRequest

        self.requests = [ScoreRequest(np.array(q), 1) for q in args["seqs"]]
        self.num_targets = sum(len(q) - 1 for q in args["seqs"])

    def rep(self, name: str) -> dict:
        import numpy as np

        r = timed(lambda: self.core.score(self.requests), work=self.num_targets)
        r["outputs"] = {"logprobs": np.stack([x.logprobs for x in r["outputs"]]),
                        "is_greedy": np.stack([x.is_greedy for x in r["outputs"]])}
        return r


if __name__ == "__main__":
    serve(ScoringJax())
