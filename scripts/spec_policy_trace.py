"""What the draft policy did, turn by turn: an adaptive speculative Engine on the embedded model.

    python scripts/spec_policy_trace.py [--method=dflash|mtp] [--num_speculative_tokens=K]
        [--batches=1,4] [--turns=11] [--new_tokens=128]

The workload of `scripts/bench.py --suite=spec_policy`'s policy side (one Engine through all
turns, B of its prompts submitted together, greedy, EOS ignored, no prefix reuse), without the
other sides: per turn its tok/s, the rounds it ran by (K, B) (the tail of a turn runs fewer
rows: requests are admitted one a round), and at B = 1 the policy's round times and the
acceptance by position after the turn. For how fast the policy learns and what its probes and
tails cost; ratios to no speculation come from the benchmark, which alternates the sides.

`--choices`: also each choice the policy scores afresh whose best K, probe or standing changed:
its round, best K, next probe and the rounds it waits, the best's expected gain over a round of
0, and per compiled K the tokens the first row that drafts expects (E) and the round's time as
the policy reads it (t, ms), with the prior's first five rates (what a held run of rounds of 0
rests on: a process that holds them where a drafting K wins shows which side is off).
"""

import os
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

METHOD = flags.DEFINE_enum("method", "dflash", ["dflash", "mtp"], "the drafter")
K = flags.DEFINE_integer("num_speculative_tokens", None, "the largest K (default: 15 / 3)")
BATCHES = flags.DEFINE_list("batches", ["1", "4"], "requests submitted together, per phase")
TURNS = flags.DEFINE_integer("turns", 11, "turns per phase")
NEW_TOKENS = flags.DEFINE_integer("new_tokens", 128, "tokens each request generates")
CHOICES = flags.DEFINE_bool("choices", False, "print the choices the policy scores afresh")


def main(argv) -> None:
    del argv
    from ninfer_jax.api import Engine
    from ninfer_jax.compile_cache import enable_persistent_cache
    from ninfer_jax.sampling_params import SamplingParams
    from scripts.benchmarks._engine_vs_program import PROMPTS

    enable_persistent_cache()
    k = K.value or (15 if METHOD.value == "dflash" else 3)
    engine = Engine.open(prefix_reuse=False, speculative=METHOD.value, num_speculative_tokens=k)
    engine.wait_compiled()
    policy = engine.core.rounds.policy
    if CHOICES.value:
        _trace_choices(policy)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS.value,
                              ignore_eos=True)
    print(f"{METHOD.value} K={k} adaptive, {NEW_TOKENS.value} greedy tokens a request, "
          f"load {os.getloadavg()[0]:.2f}")
    for b in (int(x) for x in BATCHES.value):
        for turn in range(TURNS.value):
            before = policy.rounds_by_kb.copy()
            start = time.perf_counter()
            handles = [engine.submit(prompt=p, sampling=sampling) for p in PROMPTS[:b]]
            tokens = sum(len(h.result(600).token_ids) for h in handles)
            rate = tokens / (time.perf_counter() - start)
            ran = policy.rounds_by_kb - before
            rounds = " ".join(f"K{kk}B{bb}:{n}" for (kk, bb), n in sorted(ran.items()))
            print(f"B={b} turn {turn:2d}: {rate:7.1f} tok/s  rounds {rounds}", flush=True)
            if b == 1:
                stats = policy.stats()
                times = {kk: ms for kk, bb, ms in stats.round_ms if bb == 1}
                print(f"    round ms at B=1 {times}; acceptance by position (all rounds) "
                      f"{[round(a, 2) for a in stats.acceptance_by_position[:8]]}")
    engine.close()


def _trace_choices(policy) -> None:
    """Wraps the policy's `_choice_for` (on this instance) to print the choices it scores
    afresh whose (best, probe, stands) changed at their B."""
    choice_for, last = policy._choice_for, {}

    def traced(rows, ks, refill):
        made = choice_for(rows, ks, refill)
        b, key = len(rows), (made.best, made.probe, made.stands)
        row = next((r for r in rows if r.acceptance is not None), None)
        if last.get(b) == key or row is None or policy._prior is None:
            return made
        last[b] = key
        prior, steps = policy._prior
        expected = policy._row_expected(row, policy._rates(row.acceptance, prior, steps))
        anchor = policy._anchor(b)
        times = {k: policy._time(k, b, anchor) for k in ks}
        print(f"    B={b} round {policy._round}: best {made.best}, probe {made.probe} in "
              f"{made.wait:.0f} rounds, stands {made.stands}, gain {made.gain:.2f}; "
              f"E {[round(expected[min(k, len(expected) - 1)], 2) for k in ks]}, "
              f"t {[round(1e3 * times[k], 2) if times[k] else None for k in ks]} (K {ks}); "
              f"prior {[round(x, 2) for x in prior[:5]]}", flush=True)
        return made

    policy._choice_for = traced


if __name__ == "__main__":
    app.run(main)
