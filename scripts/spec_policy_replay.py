"""The draft policy replayed on the embedded model's own acceptance, on a simulated clock.

    python scripts/spec_policy_replay.py --collect [--method=dflash|mtp]
    python scripts/spec_policy_replay.py [--method=dflash|mtp] [--machine=slow|fast]
        [--batches=1,4] [--seeds=10] [--turns=15]

The `spec_policy` benchmark's ratios move with the machine: its rounds of 0 ran ~3.6 ms at
B = 1 on one machine (DFlash K = 15 then 1.2x off) and ~0.5 ms on another (every K lost), and
the same code's processes ran up to ±9% apart. A replay separates the policy from both.

`--collect`: for each of the benchmark's prompts (its 128 greedy tokens, EOS ignored) and each
compiled K of an adaptive Program (`ProgramConfig.round_drafts`), the drafts a round of K
accepts when it starts at output position p = 1..127 (the context prefilled, one round of K
decoded; DFlash's drafts depend on the block's size, so every K is measured, not cut from the
largest). Written to `tests/fixtures/spec_policy/acceptance_<method>.json`.

Replay: turns of the benchmark's shape (B fresh requests of the prompts together, 128 tokens
each, nothing waiting; a row's round of K commits 1 + its accepted drafts, at most its budget;
each policy turn followed by one of requests with speculation off, as the benchmark's
"policy:off" side runs in the same Engine) driven by `DraftPolicy` on a clock that advances a
round's time per (K, B) (`MACHINES`: round times measured on three machines, each round times a
log-normal factor of sigma `--sigma`). Prints, per B, the decode tok/s of the policy and of
every fixed K (the turn's tokens after each request's first over its seconds, summed over the
requests, as the benchmark measures; the mean over seeds), the policy over off and over the best
fixed K (its mean and its worst seed), and its rounds by K. A round of 0 is off's time bare and
the machine's ("upkeep", B) more with the drafter's upkeep; bare rounds leave a row's drafter
context stale as the Program's do (`RowOutlook.stale`: the policy drafts for it only after that
many rounds of upkeep). Not simulated: bursts of the machine, a change of K slowing its first
rounds, the host's work, the batch filling one request a round. It put the cost of probes that
came 1.7x as often at 0.7% of the fast machine's B = 1 where the benchmark showed several
percent (docs/speculative.md, "Replayed acceptance"): a change it approves still needs the
benchmark.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import sys

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "spec_policy"
NEW_TOKENS = 128

# (K, B) -> ms of a round on three machines, from `spec_policy` runs: rounds of 0 from the off
# side's decode tok/s (B rows over it), drafting rounds the policy's estimates at the end of the
# run (`policy_stats.round_ms`; its rounds of 0 there were taken in bursts or include more of
# the host's work); ("upkeep", B): what a round of 0 with the drafter's upkeep took more than
# off's (the run's "upkeep" lines, the median over its runs; off's rounds and bare ones have
# none). "slow": `results/spec_policy_2026-12-07_dflash_x.json`; "fast": `_dflash_z`, `_za`,
# `_zb` and `_mtp_s`. (The slow machine's MTP estimates do not rise with K: left out.) "mid":
# `_dflash_zc`, its drafting rounds from the fixed Ks' decode tok/s and the rounds each story
# takes at that K in the fixture (the policy's own estimates there put K = 15 under K = 8),
# K = 1 the policy's, the upkeep measured in one process through the Program (1.11x a bare
# round of 0 at B = 1, 1.04x at B = 4).
MACHINES = {
    "dflash": {
        "slow": {(0, 1): 3.39, (1, 1): 8.55, (4, 1): 12.29, (8, 1): 14.88, (15, 1): 16.38,
                 (0, 4): 6.29, (1, 4): 14.22, (4, 4): 19.29, (8, 4): 28.31, (15, 4): 37.28,
                 ("upkeep", 1): 0.0, ("upkeep", 4): 0.01},
        "fast": {(0, 1): 0.52, (1, 1): 2.17, (4, 1): 3.04, (8, 1): 4.19, (15, 1): 4.53,
                 (0, 4): 1.16, (1, 4): 4.27, (4, 4): 5.78, (8, 4): 7.69, (15, 4): 10.74,
                 ("upkeep", 1): 0.11, ("upkeep", 4): 0.02},
        "mid": {(0, 1): 1.39, (1, 1): 5.35, (4, 1): 6.6, (8, 1): 7.1, (15, 1): 8.5,
                (0, 4): 3.0, (1, 4): 6.6, (4, 4): 10.7, (8, 4): 13.3, (15, 4): 17.2,
                ("upkeep", 1): 0.1, ("upkeep", 4): 0.05},
    },
    "mtp": {
        "fast": {(0, 1): 0.50, (1, 1): 1.45, (2, 1): 2.01, (3, 1): 2.41,
                 (0, 4): 1.47, (1, 4): 3.42, (2, 4): 4.74, (3, 4): 5.73,
                 ("upkeep", 1): 0.0, ("upkeep", 4): 0.03},
    },
}


def _define_flags() -> None:
    """The command line's flags (defined only when run as a script: a test imports this module
    beside others whose flags share names)."""
    flags.DEFINE_enum("method", "dflash", ["dflash", "mtp"], "the drafter")
    flags.DEFINE_bool("collect", False, "measure the acceptance fixture instead")
    flags.DEFINE_enum("machine", "slow", ["slow", "mid", "fast"], "the round times")
    flags.DEFINE_list("batches", ["1", "4"], "requests a turn")
    flags.DEFINE_integer("seeds", 10, "replays, each with its own round-time noise")
    flags.DEFINE_integer("turns", 15, "measured turns a replay (after 2 warm-up turns)")
    flags.DEFINE_float("sigma", 0.08, "log-normal noise of a round's time")


def collect(method: str) -> dict:
    """{"ks": [...], "prompts": [{"out": ids, "accepted": {K: [a(p) for p = 1..127]}}]}."""
    from ninfer_jax.api import Engine
    from ninfer_jax.compile_cache import enable_persistent_cache
    from ninfer_jax.sampling_params import SamplingParams
    from scripts.benchmarks._engine_vs_program import PROMPTS

    enable_persistent_cache()
    kmax = 15 if method == "dflash" else 3
    engine = Engine.open(max_concurrency=1, prefix_reuse=False, speculative=method,
                         num_speculative_tokens=kmax, draft_policy="adaptive")
    engine.wait_compiled()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    texts = PROMPTS[:4]
    prompts = [list(engine.frontend.prepare(prompt=t).token_ids) for t in texts]
    outs = [list(engine.submit(prompt=t, sampling=greedy).result(600).token_ids) for t in texts]
    engine.close()  # its worker stops; the Program is driven from here on
    prog = engine.core.program
    ks = [k for k in prog.limits.round_drafts if k]
    result = {"method": method, "ks": ks, "window": prog.limits.context_window,
              "new_tokens": NEW_TOKENS, "prompts": []}
    for prompt, out in zip(prompts, outs):
        accepted = {}
        for k in ks:
            row = []
            for p in range(1, NEW_TOKENS):  # prefilled: the prompt and out[:p - 1]; its token
                ids = prompt + out[:p - 1]  # is out[p - 1], the round's first is out[p]
                h = prog.materialize(prog.plan_admission(len(ids), k + 2), ids)
                while (batch := prog.prefill(h)) is None:
                    pass
                prog.commit(batch, [1])
                batch = prog.decode([h], drafts=k)
                produced = int(batch.produced[0])
                got = [int(t) for t in batch.tokens[0, :produced]]
                want = (out + [None] * (k + 1))[p:p + produced]
                if got[:NEW_TOKENS - p] != want[:NEW_TOKENS - p]:
                    raise AssertionError(f"round at {p} proposed {got}, greedy says {want}")
                row.append(produced - 1)
                prog.commit(batch, [produced])
                prog.release(h)
            accepted[str(k)] = row
        result["prompts"].append({"out": out, "accepted": accepted})
    return result


def load(method: str) -> dict:
    return json.loads((FIXTURES / f"acceptance_{method}.json").read_text())


def replay(policy, trace: dict, times: dict, b: int, turns: int, seed: int,
           sigma: float = 0.08, warmup: int = 2, off_turns: bool = True) -> tuple[float, dict]:
    """Decode tok/s of `policy` (a DraftPolicy, or a fixed K) over `turns` turns of B requests,
    the mean over turns, and its rounds by K. `off_turns`: after each turn a DraftPolicy also
    runs one of requests with speculative="off" (the benchmark's "policy:off" side, in the same
    Engine: its rounds of 0 count toward the policy's probe waits), not measured."""
    import collections

    import numpy as np

    from ninfer_jax.engine.spec_policy import RowAcceptance, RowOutlook

    rng = np.random.default_rng(seed)
    fixed = isinstance(policy, int)
    positions = max(trace["ks"])
    now, speeds, rounds = 0.0, [], collections.Counter()
    sides = [(turn, speculative) for turn in range(warmup + turns)
             for speculative in ((True, False) if off_turns and not fixed else (True,))]
    for turn, speculative in sides:
        # [acceptance (None: speculation off), output position (the tokens it has: the
        # prefill gave the first), trace, the position after its last bare round (0: none;
        # `HostProgram.context_stale`)]
        rows = [[RowAcceptance(positions) if speculative else None, 1,
                 trace["prompts"][i]["accepted"], 0] for i in range(b)]
        start, speed = now, 0.0
        while live := [r for r in rows if r[1] < NEW_TOKENS]:
            outlook = [RowOutlook(a, NEW_TOKENS - n, max(0, c + trace["window"] - n)
                                  if c and a is not None else 0) for a, n, _, c in live]
            if fixed:
                k, bare = policy, False
            else:
                k = policy.choose(outlook, lambda k, b: True)
                bare = not k and policy.bare(outlook)
                policy.dispatched(k, outlook, bare)
            upkeep = not fixed and not k and not bare  # off's rounds and bare ones have none
            now += 1e-3 * times[(k, len(live))] * math.exp(rng.normal(0.0, sigma)) * (
                1.0 + times[("upkeep", len(live))] * upkeep)
            done = 0
            for r in live:
                if bare:
                    r[3] = r[1] + 1
                limit = min(k + 1, NEW_TOKENS - r[1])
                produced = 1 + min(r[2][str(k)][r[1] - 1], limit - 1) if k else 1
                r[1] += produced
                done += produced
                if r[1] >= NEW_TOKENS:
                    speed += (NEW_TOKENS - 1) / (now - start)
                if not fixed:
                    policy.add_row(r[0], k, limit, produced, produced)
            if not fixed:
                policy.round_done(k, len(live), now, done, bare)
            if turn >= warmup and speculative:
                rounds[k] += 1
        if not fixed:
            policy.interrupt()  # the next turn's prefills
        now += 0.02
        if turn >= warmup and speculative:
            speeds.append(speed)
    return sum(speeds) / len(speeds), dict(sorted(rounds.items()))


def times_for(method: str, machine: str, b: int) -> dict:
    """(K, n) -> ms and ("upkeep", n) -> its share, for n = 1..B: the machine's at 1 and 4
    rows, linear between."""
    table = MACHINES[method][machine]
    out = {}
    for (k, bb), at1 in table.items():
        if bb == 1:
            at4 = table[(k, 4)]
            for n in range(1, b + 1):
                out[(k, n)] = at1 + (at4 - at1) * (n - 1) / 3
    return out


def compare(method: str, machine: str, b: int, seeds: int, turns: int = 15,
            sigma: float = 0.08) -> dict:
    """The policy against every fixed K at B: {"fixed": {K: decode tok/s, the mean over
    seeds}, "policy": [its decode tok/s per seed], "rounds": its last seed's rounds by K}."""
    from ninfer_jax.engine.spec_policy import DraftPolicy

    trace = load(method)
    times = times_for(method, machine, b)
    ks = (0, *trace["ks"])
    fixed = {k: sum(replay(k, trace, times, b, turns, s, sigma)[0] for s in range(seeds)) / seeds
             for k in ks}
    policy, rounds = [], {}
    for s in range(seeds):
        rate, rounds = replay(DraftPolicy(ks, method, trace["window"]), trace, times, b, turns,
                              s, sigma)
        policy.append(rate)
    return {"fixed": fixed, "policy": policy, "rounds": rounds}


def main(argv) -> None:
    del argv
    f = flags.FLAGS
    method = f.method
    if f.collect:
        FIXTURES.mkdir(parents=True, exist_ok=True)
        path = FIXTURES / f"acceptance_{method}.json"
        path.write_text(json.dumps(collect(method), separators=(",", ":")) + "\n")
        print(f"wrote {path}")
        return
    if f.machine not in MACHINES[method]:
        raise app.UsageError(f"--machine for {method}: one of {list(MACHINES[method])}")
    for b in (int(x) for x in f.batches):
        r = compare(method, f.machine, b, f.seeds, f.turns, f.sigma)
        fixed, got = r["fixed"], r["policy"]
        best = max(fixed, key=fixed.get)
        mean = sum(got) / len(got)
        print(f"{method} B={b} {f.machine}: fixed K / off "
              + " ".join(f"K={k} {fixed[k] / fixed[0]:.3f}" for k in fixed)
              + f"; policy / off {mean / fixed[0]:.3f}, / best fixed (K={best}) "
              f"{mean / fixed[best]:.3f} (worst seed {min(got) / fixed[best]:.3f}); "
              f"last seed's rounds by K {r['rounds']}")


if __name__ == "__main__":
    _define_flags()
    app.run(main)
