"""Where the host's time goes per decode round, on the embedded demo model.

    python scripts/profile_host_path.py [--new_tokens=256] [--batches=1,8] [--sampled] [--top=N]

Opens the demo Engine (prefix reuse off), waits for its compiles, then for each B runs B
requests of `--new_tokens` each (twice: a warm-up, then profiled) with cProfile on the Engine's
worker thread and on the consumer that streams the deltas to /dev/null (as `ninfer generate`
writes them). Prints the worker's own time (cProfile's tottime) per decode round, grouped by
where it is spent (the step executables' dispatch, the Program's host side, the Engine core,
the Frontend's detokenization, event publication, numpy), the rows' `stats().rounds` figures
(host us per round and per row, the share spent waiting for a round's tokens), and the
consumers' CPU time per delta. Sampled: the command line's defaults (temperature 0.8, top-p 0.95).
"""

from __future__ import annotations

import collections
import cProfile
import os
import pstats
import sys
import threading
import time

from absl import app, flags

NEW_TOKENS = flags.DEFINE_integer("new_tokens", 256, "tokens per request", lower_bound=2)
BATCHES = flags.DEFINE_list("batches", ["1", "8"], "concurrent requests (B) to profile")
SAMPLED = flags.DEFINE_bool("sampled", True, "the command line's sampling (else greedy)")
TOP = flags.DEFINE_integer("top", 0, "also list the worker's N costliest functions (own time)")

GROUPS = (  # (group, path fragment) in order: the first match names a function's group
    ("step dispatch (jax)", "/jax/"), ("step dispatch (jax)", "jaxlib"),
    ("Program host side", "ninfer_jax/program/"), ("Frontend (detokenize, stops)", "frontend/"),
    ("event publication", "engine/handle.py"), ("event publication", "engine/events.py"),
    ("Engine core", "ninfer_jax/engine/"), ("numpy", "numpy"), ("queues, locks", "queue"),
    ("queues, locks", "threading"))


def _group(filename: str, name: str) -> str:
    if filename == "~":  # a builtin: numpy's C functions name themselves
        return "numpy" if "numpy" in name else "builtins"
    return next((g for g, frag in GROUPS if frag in filename), "other")


def _by_group(prof: cProfile.Profile) -> dict[str, float]:
    totals: dict[str, float] = collections.defaultdict(float)
    for (filename, _, name), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        totals[_group(filename, name)] += tottime
    return totals


def main(argv):
    del argv
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from ninfer_jax.api import Engine
    from ninfer_jax.compile_cache import enable_persistent_cache
    from ninfer_jax.engine import Delta
    from ninfer_jax.sampling_params import SamplingParams

    enable_persistent_cache()
    batches = [int(b) for b in BATCHES.value]
    engine = Engine.open(None, max_concurrency=max(batches), verify_weights=False,
                         prefix_reuse=False, max_seq_len=NEW_TOKENS.value + 64)
    engine.core.program.wait_compiled()
    prompts = ["Once upon a time", "Tom had a big red ball.", "One day, a small bird",
               "Anna liked to draw pictures of cats.", "Ben and Mia went to the park.",
               "There was a big tree in the garden.", "Sam wanted a new toy.",
               "The cat sat by the window."]
    core = engine.core
    sink = open(os.devnull, "w")  # noqa: SIM115 - written by every consumer thread
    print(f"demo model, {NEW_TOKENS.value} new tokens a request, "
          f"{'sampled (temperature 0.8, top-p 0.95)' if SAMPLED.value else 'greedy'}; "
          f"load {os.getloadavg()[0]:.1f}")
    for b in batches:
        for profiled in (False, True):
            worker, consumer_cpu = cProfile.Profile(), [0.0] * b
            iterate = core._iterate

            def profiled_iterate(iterate=iterate, worker=worker):
                worker.enable()
                try:
                    return iterate()
                finally:
                    worker.disable()

            if profiled:
                core._iterate = profiled_iterate
            before = core.stats().rounds
            deltas = [0] * b

            def consume(i: int, deltas=deltas, consumer_cpu=consumer_cpu) -> None:
                sp = SamplingParams(temperature=0.8 if SAMPLED.value else 0.0, top_p=0.95,
                                    seed=i, max_new_tokens=NEW_TOKENS.value, ignore_eos=True)
                handle = engine.submit(prompts[i % len(prompts)], sampling=sp)
                cpu = time.thread_time()
                for event in handle:
                    if isinstance(event, Delta) and event.text:
                        sink.write(event.text)
                        sink.flush()
                        deltas[i] += 1
                consumer_cpu[i] = time.thread_time() - cpu

            start = time.perf_counter()
            threads = [threading.Thread(target=consume, args=(i,)) for i in range(b)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - start
            core._iterate = iterate
            if not profiled:
                continue
            after = core.stats().rounds
            rounds, rows = after.rounds - before.rounds, after.rows - before.rows
            host, wait = after.host_s - before.host_s, after.wait_s - before.wait_s
            print(f"\nB={b}: {rounds} decode rounds, {rows} rows in {seconds:.2f} s "
                  f"({b * NEW_TOKENS.value / seconds:.0f} tok/s); worker host "
                  f"{1e6 * host / rounds:.0f} us a round, {1e6 * host / rows:.0f} us a row; "
                  f"waited for tokens {wait / (host + wait):.0%} of its decode iterations")
            groups = _by_group(worker)
            total = sum(groups.values())
            print(f"  worker (profiled: cProfile adds its own cost), us per round: "
                  f"{1e6 * total / rounds:.0f} in all")
            for name, value in sorted(groups.items(), key=lambda kv: -kv[1]):
                print(f"    {name:<32}{1e6 * value / rounds:>8.0f}")
            stats = pstats.Stats(worker).stats
            costliest = sorted(stats.items(), key=lambda kv: -kv[1][2])[:TOP.value]
            for (filename, line, name), (_, calls, own, _, _) in costliest:
                where = f"{os.path.basename(filename)}:{line} {name}"
                print(f"      {where[:60]:<60}{1e6 * own / rounds:>8.0f} us "
                      f"({calls / rounds:.1f} calls a round)")
            print(f"  consumers (handle iteration, text writes; CPU time): "
                  f"{1e6 * sum(consumer_cpu) / max(sum(deltas), 1):.0f} us a delta over "
                  f"{sum(deltas)} deltas")
    print(f"\n{_dispatch_floor(core.program, max(batches))}")
    engine.close()


def _dispatch_floor(program, batch: int) -> str:
    """What dispatching the decode step's arguments costs alone: an executable that takes the
    params and pools leaves (pools donated and returned as they are) and reads one value of
    each; on XLA:CPU the rest of the step's "dispatch" is the step's own work, run by the
    calling thread before the call returns."""
    import time

    import jax

    leaves = (program.params, program.pools)

    def touch(params, pools):
        firsts = [a.reshape(-1)[:1].sum().astype("float32")  # an empty leaf adds 0
                  for a in jax.tree.leaves((params, pools))]
        return pools, sum(firsts)

    trivial = jax.jit(touch, donate_argnums=1)
    pools = jax.tree.map(lambda a: a.copy(), program.pools)
    for _ in range(3):
        pools, _ = trivial(program.params, pools)
    jax.block_until_ready(pools)
    start, n = time.perf_counter(), 100
    for _ in range(n):
        pools, _ = trivial(program.params, pools)
    floor = (time.perf_counter() - start) / n
    jax.block_until_ready(pools)
    count = len(jax.tree.leaves(leaves))
    return (f"dispatch floor: {1e6 * floor:.0f} us a call for the {count} params and pool "
            f"leaves of decode({batch}) through an executable that reads one value "
            f"of each (jax's C++ call; the rest of a step's dispatch time on XLA:CPU is the "
            f"step's work run before the call returns)")


if __name__ == "__main__":
    app.run(main)
