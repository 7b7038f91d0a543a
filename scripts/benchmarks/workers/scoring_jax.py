"""Worker: our CausalScoreCore on a model directory (the `scoring` suite).

setup args: path (HF checkpoint dir, loaded with `load_model`), config (`ScoringConfig`
settings), code (optional: a checkout whose `ninfer_jax` this worker runs instead of its own,
to measure an earlier commit in the same turns; setup reports the file it loaded).
Measurement (prepare args {"seqs": [[ids], ...], "firsts": [int, ...], "unit": "tokens" |
"requests"}): a repetition scores every request (sequence s scored from index first on) in one
`score` call; its work is the scored tokens or the requests; outputs the log-probs and greedy
flags of every request, concatenated in order, and the share of the calls' input positions
that were real tokens (`Occupancy.fill`; absent for a checkout without it).
"""

from __future__ import annotations

import sys
import time

from scripts.benchmarks._worker import BenchWorker, serve, timed


class ScoringJax(BenchWorker):
    def setup(self, args: dict) -> dict:
        if args.get("code"):  # before the first import of ninfer_jax
            sys.path.insert(0, args["code"])
        import jax

        import ninfer_jax
        from ninfer_jax.compile_cache import enable_persistent_cache
        from ninfer_jax.loader import load_model
        from ninfer_jax.scoring import CausalScoreCore, ScoringConfig

        enable_persistent_cache()
        start = time.perf_counter()
        model = load_model(args["path"], verify=False)
        load_s = time.perf_counter() - start
        start = time.perf_counter()
        self.core = CausalScoreCore(model.config, model.params, ScoringConfig(**args["config"]))
        return {"load_s": load_s, "compile_s": time.perf_counter() - start,
                "executables": len(self.core.keys()), "jax": jax.__version__,
                "ninfer_jax": ninfer_jax.__file__}

    def prepare(self, name: str, args: dict) -> None:
        import numpy as np

        from ninfer_jax.scoring import ScoreRequest

        self.requests = [ScoreRequest(np.array(q), f) for q, f in zip(args["seqs"], args["firsts"])]
        targets = sum(len(q) - f for q, f in zip(args["seqs"], args["firsts"]))
        self.work = targets if args["unit"] == "tokens" else len(self.requests)

    def rep(self, name: str) -> dict:
        import numpy as np

        before = getattr(self.core, "occupancy", None)  # None: a checkout from before it
        r = timed(lambda: self.core.score(self.requests, roll=True), work=self.work)
        r["outputs"] = {"logprobs": np.concatenate([x.logprobs for x in r["outputs"]]),
                        "is_greedy": np.concatenate([x.is_greedy for x in r["outputs"]])}
        if before is not None:
            after = self.core.occupancy
            r["outputs"]["fill"] = (after.tokens - before.tokens) / (after.slots - before.slots)
        return r


if __name__ == "__main__":
    serve(ScoringJax())
