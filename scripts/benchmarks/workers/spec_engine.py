"""Worker: one Engine on the embedded model, speculation as set up (the `spec_policy` suite).

setup args: settings (`Engine.open` keywords: max_concurrency, speculative,
num_speculative_tokens, draft_policy); the Engine compiles every executable before the first
turn. Measurements:
- "b<B>" (prepare args {"prompts": [text, ...], "new_tokens": n, "speculative": "on" or "off"
  (`SamplingParams.speculative`, default "on")}; any name that starts with it, so one Engine
  holds two such measurements, its requests' speculation on and off): a repetition submits
  every prompt together, greedy with ignore_eos, and waits for the last result; its work is
  the tokens generated; outputs the token ids, the Engine's speculative statistics (and its
  decode rounds by K and its bare rounds in this repetition), the CPU time of its worker
  thread per decode round (host work: planning, dispatch, publication) and what
  a client of each request saw: its first token's arrival and its end (a thread a request
  reads events until the first token, then sleeps until the end: `_Watch`), hence the decode
  tok/s (each request's tokens after its first over the seconds from its first to its end,
  summed over the requests) and the last request's first token from the submit.
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
        self.handles, self.sampling = [], {}
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
            self.sampling[name] = SamplingParams(
                temperature=0.0, max_new_tokens=args["new_tokens"], ignore_eos=True,
                speculative=args.get("speculative", "on"))
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
        before = self.engine.stats()
        by_kb = self.engine.core.rounds.policy.rounds_by_kb.copy()
        rounds, cpu = before.rounds.rounds, time.clock_gettime(self.worker_clock)
        start = time.perf_counter()
        watches = [_Watch(self.engine.submit(prompt=p, sampling=self.sampling[name]))
                   for p in self.prompts]
        for w in watches:
            w.join()
        seconds = time.perf_counter() - start
        stats = self.engine.stats()
        worker_cpu = time.clock_gettime(self.worker_clock) - cpu
        results = [w.result for w in watches]
        return {"seconds": seconds, "work": sum(len(r.token_ids) for r in results),
                "outputs": {"tokens": [list(r.token_ids) for r in results],
                            "stats": dataclasses.asdict(stats.speculative),
                            "rounds_by_drafts": _since(stats.speculative.rounds_by_drafts,
                                                       before.speculative.rounds_by_drafts),
                            "rounds_by_kb": {  # "K,B": rounds (a turn's tail runs fewer rows)
                                f"{k},{b}": n for (k, b), n in sorted(
                                    (self.engine.core.rounds.policy.rounds_by_kb - by_kb).items())},
                            "bare_rounds": stats.speculative.bare_rounds
                            - before.speculative.bare_rounds,
                            "worker_cpu_ms_per_round":
                                1e3 * worker_cpu / max(stats.rounds.rounds - rounds, 1),
                            "decode_tok_s": sum(w.decode_tok_s for w in watches),
                            "first_token_ms": 1e3 * (max(w.first for w in watches) - start)}}

    def finish(self, name: str) -> None:
        for h in self.handles:
            self.program.release(h)
        self.handles = []


def _since(after: tuple, before: tuple) -> dict[int, int]:
    """Rounds by K between two of the Engine's cumulative ((K, rounds), ...)."""
    was = dict(before)
    return {k: n - was.get(k, 0) for k, n in after if n - was.get(k, 0)}


class _Watch(threading.Thread):
    """A request's client: reads its events until the first token arrives (its time and the
    tokens by then), then waits for the end (`RequestHandle.result`: no wake-up a token)."""

    def __init__(self, handle):
        super().__init__(daemon=True)
        self.handle, self.error = handle, None
        self.start()

    def run(self) -> None:
        from ninfer_jax.engine.events import Delta

        try:
            self.before = 0
            while not self.handle.done:  # up to the first token's event (or the end)
                event = self.handle.next_event(600)
                if isinstance(event, Delta) and event.token_ids:
                    self.before = len(event.token_ids)
                    break
            self.first = time.perf_counter()
            self.result = self.handle.result(600)
            self.end = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 - re-raised by join
            self.error = e

    def join(self, timeout: float | None = None) -> None:
        super().join(timeout)
        if self.error is not None:
            raise self.error

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first arrival over the seconds from it to the end."""
        return (len(self.result.token_ids) - self.before) / max(self.end - self.first, 1e-9)


if __name__ == "__main__":
    serve(SpecEngine())
