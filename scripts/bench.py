"""The project's one benchmark entry point.

    python scripts/bench.py --suite=SUITE [--out=DIR]

Each suite lives in `scripts/benchmarks/<suite>.py` and exposes `run(out_dir) -> dict`; this
script writes the result to `<out_dir>/<suite>.json` (the suite prints its table). A suite that
compares engines runs each one in its own long-lived worker process and alternates repetitions
between them (`scripts/benchmarks/_abab.py`); results are medians with their min and max, per-pair
ratios and the load average. Suites take their settings from BENCH_* environment variables.
"""

from __future__ import annotations

import importlib
import json
import os
import pathlib
import sys

from absl import app, flags

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from scripts.benchmarks._env import SettingError

FLAGS = flags.DEFINE_string("suite", None, "benchmark suite: a module in scripts/benchmarks/")
OUT = flags.DEFINE_string("out", "bench_out", "directory for JSON results and plots")


def main(argv):
    del argv
    known = sorted(
        p.stem for p in (pathlib.Path(__file__).parent / "benchmarks").glob("*.py")
        if not p.stem.startswith("_")
    )
    if FLAGS.value not in known:
        raise app.UsageError(f"--suite must be one of {known}, got {FLAGS.value!r}")
    module = importlib.import_module(f"scripts.benchmarks.{FLAGS.value}")
    os.makedirs(OUT.value, exist_ok=True)
    try:
        result = module.run(OUT.value)
    except SettingError as e:
        raise app.UsageError(str(e)) from None
    path = os.path.join(OUT.value, f"{FLAGS.value}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
