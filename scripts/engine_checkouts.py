"""The engine suite on two checkouts in turn (ABAB), to tell a change from noise.

    python -m scripts.engine_checkouts OLD_DIR NEW_DIR [--pairs=4] [--out=DIR]

Each run is `scripts/bench.py --suite=engine` in its checkout (its own process, its own code on
PYTHONPATH, BENCH_ENGINE_STARTUP=0: the Engine against its own Program at C = 1 and 8, greedy
and sampled); runs alternate OLD, NEW, OLD, NEW, ... Prints, per case and checkout, the median
over runs (min-max) of each run's median Engine/Program ratio, the worker's host microseconds
per decode round and the Engine's tok/s, and the load average. Make OLD_DIR with
`git worktree add /tmp/old COMMIT`.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile


def run_suite(checkout: pathlib.Path, out: pathlib.Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "BENCH_ENGINE_STARTUP": "0"}
    proc = subprocess.run([sys.executable, "scripts/bench.py", "--suite=engine", f"--out={out}"],
                          cwd=checkout, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.exit(f"the engine suite failed in {checkout}:\n{proc.stderr[-4000:]}")
    return json.loads((out / "engine.json").read_text())


def _spread(xs: list[float], digits: int) -> str:
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


def summary(runs: dict[str, list[dict]]) -> str:
    lines = []
    for case in runs["old"][0]["comparison"]["levels"]:
        for side, results in runs.items():
            levels = [r["comparison"]["levels"][case] for r in results]
            ratio = [lv["ratios"]["engine/program"]["median"] for lv in levels]
            host = [lv["host"]["us_per_round"]["median"] for lv in levels]
            rate = [lv["sides"]["engine"]["rate"]["median"] for lv in levels]
            load = [lv["load_1min"]["max"] for lv in levels]
            lines.append(f"{case:>10} {side}: {len(levels)} runs, Engine/Program "
                         f"{_spread(ratio, 2)}, host us/round {_spread(host, 0)}, Engine tok/s "
                         f"{_spread(rate, 0)}, load {min(load):.1f}-{max(load):.1f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", type=pathlib.Path)
    parser.add_argument("new", type=pathlib.Path)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--out", type=pathlib.Path, default=None,
                        help="where each run's engine.json goes (default: a temp dir)")
    args = parser.parse_args()
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="engine_checkouts_"))
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for i in range(args.pairs):
        for side, checkout in (("old", args.old), ("new", args.new)):
            print(f"run {i + 1}/{args.pairs} {side} (load {os.getloadavg()[0]:.1f})", flush=True)
            runs[side].append(run_suite(checkout.resolve(), out / f"{side}{i}"))
    print(summary(runs))
    print(f"runs in {out}")


if __name__ == "__main__":
    main()
