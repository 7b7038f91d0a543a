"""Worker: one Engine on the embedded model, speculation as set up (the `spec_policy` suite).

setup args: settings (`Engine.open` keywords: max_concurrency, speculative,
num_speculative_tokens, draft_policy); the Engine compiles every executable before the first
turn. Measurements:
- "b<B>" (prepare args {"prompts": [text, ...], "new_tokens": n}): a repetition submits every
  prompt together, greedy with ignore_eos, and waits for the last result; its work is the
  tokens generated; outputs the token ids, the Engine's speculative statistics and the CPU
  time of its worker thread per decode round (host work: planning, dispatch, publication).
- "upkeep_b<B>" (prepare args {"prompts": [...], "budget": n, "rounds": r, "bare": bool}):
  the Engine's worker stops (its Program stays usable) and a repetition runs r rounds of 0
  drafts on B prefilled sequences through the Program (`decode(drafts=0, bare=bare)` +
  commit, chained on the device as the Engine's are; the sequences of an earlier upkeep
  measurement released first); work: rounds.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time

from scripts.benchmarks._worker import BenchWorker, serve


class SpecEngine(BenchWorker):
    def setup(self, args: dict) -> dict:
        if args.get("code"):  # a checkout's ninfer_jax instead (before its first import)
            sys.path.insert(0, args["code"])
        import jax

        from ninfer_jax.api import Engine
        from ninfer_jax.compile_cache import enable_persistent_cache

        enable_persistent_cache()
        start = time.perf_counter()
        self.engine = Engine.open(prefix_reuse=False, **args["settings"])
        self.engine.wait_compiled()
        self.program = self.engine.core.program
        self.handles = []
        worker = next(t for t in threading.enumerate() if t.name == "ninfer-engine")
        self.worker_clock = time.pthread_getcpuclockid(worker.ident)
        import ninfer_jax

        return {"open_s": time.perf_counter() - start, "jax": jax.__version__,
                "ninfer_jax": ninfer_jax.__file__,
                "bare_window": getattr(self.program.limits, "context_window", 0)}

    def prepare(self, name: str, args: dict) -> None:
        from ninfer_jax.sampling_params import SamplingParams

        self.prompts = args["prompts"]
        if not name.startswith("upkeep"):
            self.sampling = SamplingParams(temperature=0.0, max_new_tokens=args["new_tokens"],
                                           ignore_eos=True)
            return
        self.engine.close()  # stops its worker: the Program is driven from here on
        prog, self.rounds, self.bare = self.program, args["rounds"], args.get("bare", False)
        for h in self.handles:
            prog.release(h)
        self.handles = []
        for text in self.prompts:
            ids = list(self.engine.frontend.prepare(prompt=text).token_ids)
            h = prog.materialize(prog.plan_admission(len(ids), args["budget"]), ids)
            while (batch := prog.prefill(h)) is None:
                pass
            prog.commit(batch, [1])
            self.handles.append(h)

    def rep(self, name: str) -> dict:
        if name.startswith("upkeep"):
            prog, start = self.program, time.perf_counter()
            for _ in range(self.rounds):
                batch = prog.decode(self.handles, drafts=0, bare=self.bare)
                prog.commit(batch, [1] * len(self.handles))
            prog.tokens(self.handles[0])  # waits for the last round
            return {"seconds": time.perf_counter() - start, "work": self.rounds,
                    "outputs": {}}
        rounds, cpu = self.engine.stats().rounds.rounds, time.clock_gettime(self.worker_clock)
        start = time.perf_counter()
        handles = [self.engine.submit(prompt=p, sampling=self.sampling) for p in self.prompts]
        results = [h.result(600) for h in handles]
        seconds = time.perf_counter() - start
        stats = self.engine.stats()
        worker_cpu = time.clock_gettime(self.worker_clock) - cpu
        return {"seconds": seconds, "work": sum(len(r.token_ids) for r in results),
                "outputs": {"tokens": [list(r.token_ids) for r in results],
                            "stats": dataclasses.asdict(stats.speculative),
                            "worker_cpu_ms_per_round":
                                1e3 * worker_cpu / max(stats.rounds.rounds - rounds, 1)}}

    def finish(self, name: str) -> None:
        for h in self.handles:
            self.program.release(h)
        self.handles = []


if __name__ == "__main__":
    serve(SpecEngine())
