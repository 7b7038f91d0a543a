"""The draft policy's host time per call, on a simulated state (no model, no jax).

    python scripts/spec_policy_host_time.py [--ks=0,1,3,7,15] [--rows=4] [--repeats=3]
        [--baseline=DIR]

Builds a DraftPolicy the way an Engine feeds it (turns of B = rows, rows - 1, ..., 1 fresh
requests, 40 rounds each, drafts right with chance 0.8, round times of a CPU where drafting
costs several rounds of 0; seeded), then times, per call: a choice scored afresh
(`_choice_for`, what a drafting round or a refresh costs), `choose` while a choice of 0
stands, `round_done`, `dispatched` and `stats`. Each round of the Engine's worker pays the
last four, and the first every REFRESH_DRAFTING rounds that draft (every REFRESH or
REFRESH_FAR rounds of 0).
`--baseline=DIR`: the same from another checkout's ninfer_jax (`git worktree add DIR COMMIT`),
in the same process, in turn. Medians of `--repeats`; the machine's noise is on both sides.
"""

import importlib.util
import os
import statistics
import sys
import time

import numpy as np
from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KS = flags.DEFINE_list("ks", ["0", "1", "3", "7", "15"], "the compiled Ks")
ROWS = flags.DEFINE_integer("rows", 4, "rows of the timed choice (the largest B)")
REPEATS = flags.DEFINE_integer("repeats", 3, "timings of each call (medians)")
BASELINE = flags.DEFINE_string("baseline", None, "another checkout to time in turn")


def _load(name: str, checkout: str):
    path = os.path.join(checkout, "ninfer_jax", "engine", "spec_policy.py")
    if not os.path.isfile(path):
        raise app.UsageError(f"--baseline={checkout!r}: no ninfer_jax/engine/spec_policy.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _cost(k: int, b: int) -> float:
    return (1 + b) * (1 + 2 * (k > 0) + 0.2 * k) * 1e-3


def _built(m, ks: tuple, rows: int):
    rng = np.random.default_rng(0)
    policy, now = m.DraftPolicy(ks, "dflash", 64), 0.0
    for _ in range(6):
        for b in range(rows, 0, -1):
            live = [[m.RowAcceptance(max(ks)), 0] for _ in range(b)]
            for _ in range(40):
                outlook = [m.RowOutlook(a, 128 - n) for a, n in live]
                k = policy.choose(outlook, lambda k, b: True)
                policy.dispatched(k, outlook)
                now += _cost(k, b)
                tokens = 0
                for r in live:
                    produced = 1
                    while produced <= k and rng.random() < 0.8:
                        produced += 1
                    r[1] += produced
                    tokens += produced
                    policy.add_row(r[0], k, k + 1, produced, produced)
                policy.round_done(k, b, now, tokens)
    return policy


def _us(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def _timings(m, ks: tuple, rows: int) -> dict[str, float]:
    policy = _built(m, ks, rows)
    outlook = [m.RowOutlook(m.RowAcceptance(max(ks)), 100) for _ in range(rows)]
    ready = lambda k, b: True  # noqa: E731

    def afresh():
        policy._choice.pop(rows, None)
        policy._choice_for(outlook, list(ks), False)

    afresh()
    out = {"choice scored afresh": _us(afresh, 2000)}
    standing = policy._choice[rows]
    policy._choice[rows] = type(standing)(**{**standing.__dict__, "best": ks[0],
                                             "stands": 10**9, "wait": 10**9})
    out["choose, a choice of 0 standing"] = _us(lambda: policy.choose(outlook, ready), 20000)
    clock = [1.0]

    def landed():
        clock[0] += 0.003
        policy.round_done(0, rows, clock[0], rows)

    out["round_done"] = _us(landed, 20000)
    out["dispatched"] = _us(lambda: policy.dispatched(0, outlook), 20000)
    out["stats"] = _us(lambda: policy.stats(0), 20000)
    return out


def main(argv) -> None:
    del argv
    ks, rows = tuple(int(k) for k in KS.value), ROWS.value
    sides = {"this checkout": _load("_policy_here", REPO)}
    if BASELINE.value:
        sides["baseline"] = _load("_policy_baseline", os.path.realpath(BASELINE.value))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for _ in range(REPEATS.value):
        for name, module in sides.items():
            runs[name].append(_timings(module, ks, rows))
    print(f"draft policy host time, µs per call (median of {REPEATS.value}; Ks {ks}, "
          f"{rows} rows; load 1-min {os.getloadavg()[0]:.2f})")
    calls = list(runs["this checkout"][0])
    print(f"{'call':<34}" + "".join(f"{name:>16}" for name in sides))
    for call in calls:
        print(f"{call:<34}" + "".join(
            f"{statistics.median(r[call] for r in runs[name]):>16.1f}" for name in sides))


if __name__ == "__main__":
    app.run(main)
