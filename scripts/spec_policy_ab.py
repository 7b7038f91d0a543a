"""The draft policy against another, in one Engine, turn by turn (a development check).

    python -m scripts.spec_policy_ab --against=c1e1862 --method=mtp --batch=1
    python -m scripts.spec_policy_ab --against=zero --method=dflash --batch=4
    python -m scripts.spec_policy_ab --against=k:8 --method=dflash --batch=1

One Engine on the embedded model (speculation `--method` up to `--k` drafts, prefix reuse off)
alternates turns between this checkout's `DraftPolicy` and the other: `--against=REV` the
`engine/spec_policy.py` of that git revision (its own counts and times: each policy object
lives through its own turns only), `--against=zero` this policy frozen at rounds of 0 (it
chooses 0 and learns nothing: the cost of the policy's choices and probes, upkeep aside),
`--against=k:N` every round drafting N (a fixed K in the same process: the spec_policy suite
runs each fixed K in a process of its own, whose speed is on its side of the ratio). A
turn submits the first B story prompts together, greedy, `ignore_eos`, 128 tokens each, and
times from submit to the last result. The same Program, process and executables serve both
sides, so the process-to-process spread of the `spec_policy` suite (its sides are separate
processes) is out of the ratio. Prints this policy / the other per turn pair, median and
quartiles, each side's rounds by K and the 1-minute load average.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_AGAINST = flags.DEFINE_string("against", "zero", "a git revision, 'zero', or 'k:N' (every "
                               "round drafts N)")
_METHOD = flags.DEFINE_enum("method", "mtp", ["mtp", "dflash"], "speculative method")
_BATCH = flags.DEFINE_integer("batch", 1, "requests per turn (1..4)", lower_bound=1, upper_bound=4)
_TURNS = flags.DEFINE_integer("turns", 20, "measured turn pairs", lower_bound=4)
_WARMUP = flags.DEFINE_integer("warmup", 3, "turn pairs first, not measured", lower_bound=0)
_TOKENS = flags.DEFINE_integer("new_tokens", 128, "tokens a request", lower_bound=2)
_K = flags.DEFINE_integer("k", None, "the largest K (default: the spec_policy suite's, mtp 3, "
                          "dflash 15)", lower_bound=1)
DEFAULT_K = {"mtp": 3, "dflash": 15}


def _policy_at(rev: str):
    """The DraftPolicy class of `engine/spec_policy.py` at git revision `rev`."""
    source = subprocess.run(["git", "show", f"{rev}:ninfer_jax/engine/spec_policy.py"],
                            capture_output=True, text=True, check=False,
                            cwd=pathlib.Path(__file__).resolve().parent.parent)
    if source.returncode:
        raise app.UsageError(f"--against: no spec_policy.py at {rev!r}: {source.stderr.strip()}")
    path = os.path.join(tempfile.mkdtemp(), "spec_policy_at_rev.py")
    with open(path, "w") as f:
        f.write(source.stdout)
    spec = importlib.util.spec_from_file_location("spec_policy_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.DraftPolicy


def _fixed_k(against: str, ks: tuple[int, ...]) -> int:
    """N of --against=k:N, one of the Program's compiled Ks that draft."""
    try:
        k = int(against[2:])
    except ValueError:
        raise app.UsageError(f"--against=k:N takes an integer N, got {against!r}") from None
    if k not in ks or k == 0:
        raise app.UsageError(f"--against=k:{k}: N must be a compiled K that drafts, one of "
                             f"{[j for j in ks if j]}")
    return k


def main(argv):
    del argv
    from ninfer_jax.api import Engine
    from ninfer_jax.sampling_params import SamplingParams
    from scripts.benchmarks._engine_vs_program import PROMPTS

    method, b = _METHOD.value, _BATCH.value
    engine = Engine.open(prefix_reuse=False, max_concurrency=4, speculative=method,
                         num_speculative_tokens=_K.value or DEFAULT_K[method],
                         draft_policy="adaptive")
    engine.wait_compiled()
    rounds = engine.core.rounds
    ours = rounds.policy
    if _AGAINST.value == "zero":
        other = type(ours)(ours.ks, ours.method)
        other.choose = lambda *args: other.ks[0]
        for name in ("dispatched", "round_done", "add_row"):
            setattr(other, name, lambda *a, **k: None)
    elif _AGAINST.value.startswith("k:"):
        k = _fixed_k(_AGAINST.value, ours.ks)
        other = type(ours)((k,), ours.method)  # not adaptive: every round drafts k
    else:
        policy = _policy_at(_AGAINST.value)
        window = ((ours.window,) if "window" in inspect.signature(policy).parameters else ())
        other = policy(ours.ks, ours.method, *window)  # bare rounds too, where it has them
    sampling = SamplingParams(temperature=0.0, max_new_tokens=_TOKENS.value, ignore_eos=True)

    def turn(policy) -> float:
        rounds.policy = policy
        start = time.perf_counter()
        handles = [engine.submit(prompt=p, sampling=sampling) for p in PROMPTS[:b]]
        tokens = sum(len(h.result(600).token_ids) for h in handles)
        return tokens / (time.perf_counter() - start)

    for _ in range(_WARMUP.value):
        turn(ours), turn(other)
    mine, theirs = [], []
    for _ in range(_TURNS.value):
        mine.append(turn(ours))
        theirs.append(turn(other))
    rounds.policy = ours
    engine.close()
    ratios = [x / y for x, y in zip(mine, theirs)]
    q1, median, q3 = statistics.quantiles(ratios, n=4)
    print(f"{method} B={b}, {_TURNS.value} turn pairs: this policy "
          f"{statistics.median(mine):,.0f} tok/s, against {_AGAINST.value} "
          f"{statistics.median(theirs):,.0f} tok/s; per pair {median:.3f} "
          f"[quartiles {q1:.3f}-{q3:.3f}, {min(ratios):.3f}-{max(ratios):.3f}]; "
          f"load 1-min {os.getloadavg()[0]:.2f}")
    print(f"rounds by K: this {dict(sorted(ours.rounds_by_k.items()))}, against "
          f"{dict(sorted(other.rounds_by_k.items()))}")


if __name__ == "__main__":
    app.run(main)
