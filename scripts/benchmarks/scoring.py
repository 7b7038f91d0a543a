"""Scoring throughput: CausalScoreCore next to transformers, each in its own process, in turns.

    python scripts/bench.py --suite=scoring --out=DIR

For each config (`demo`: the embedded model exported as an HF checkpoint; `tiny`, `medium`:
random fp32 weights, see `_checkpoint.py`) three long-lived workers load the same directory:
ours (`workers/scoring_jax.py`: `CausalScoreCore`, default settings up to windows of MAX_LEN),
ours as it was before shared contexts and packing (`ours_plain`: `pack=False,
share_contexts=False`, every window alone in its row) and transformers (`workers/scoring_hf.py`:
`Qwen3_5ForCausalLM` forward + `log_softmax` + gather + argmax, longest first in padded batches
of HF_ROWS, as lm-evaluation-harness's HF backend scores). Tasks (random token ids):

- rolling: disjoint rolling windows of a long text (lm-eval `loglikelihood_rolling`): WINDOWS
  sequences of WINDOW + 1 tokens, every token after the first scored; tokens/s.
- choice: a four-way multiple choice (lm-eval `loglikelihood`): CONTEXTS contexts of 140-169
  tokens, each with four continuations of 10-21 tokens; pairs/s.
- short: RECORDS short texts of 20-80 tokens (perplexity filtering), every token after the
  first scored; records/s.

Set-up is timed and reported apart; then one warm-up repetition per side and REPS repetitions in
turn (ours, ours_plain, transformers, ...), with the load average around each. Reported per
task: each side's rate (median [min-max]), the per-round ratios, the share of our calls' input
positions that were real tokens (fill), and agreement: ours against transformers and against
ours_plain (max log-prob error relative to the largest |log-prob|, greedy flags that agree).
On the rolling task a `matmul_floor` worker (`workers/scoring_floor.py`) takes its turn too:
every weight matrix and the head applied to as many rows as the task has targets, as XLA dots
and nothing else (a yardstick of the matmul work, not a strict bound: see
`scripts/scoring_matmul_floor.py`).
`lm_eval_choice` (below) is the lm-evaluation-harness check of the same sharing and
`cli_short` times `ninfer score` processes on the short records (the batch job's view).

With BENCH_SCORING_BASELINE=DIR (a checkout of an earlier commit: `git worktree add DIR COMMIT`)
a fourth worker, `baseline`, runs that checkout's `ninfer_jax` with its own defaults up to
windows of MAX_LEN, in the same turns on every task: today's code against the code of then,
both measured now (ratio `ours/baseline`).

Settings (environment): BENCH_SCORING_CONFIGS=demo,medium  BENCH_SCORING_TASKS (default: every
task on demo and tiny, rolling on medium)  BENCH_SCORING_WINDOWS=16
BENCH_SCORING_WINDOW=256  BENCH_SCORING_CONTEXTS (48, 4 on medium)  BENCH_SCORING_RECORDS
(10000, 48 on medium)  BENCH_SCORING_HF_ROWS=16  BENCH_SCORING_REPS=3  BENCH_SCORING_WARMUP=1
BENCH_SCORING_LM_EVAL=1 (0: skip the lm-eval check)  BENCH_SCORING_CLI=1 (0: skip the
`ninfer score` turns)  BENCH_SCORING_BASELINE (none)  BENCH_TIMEOUT_S=1800
BENCH_TORCH_OMP_WAIT_POLICY (see `_env.py`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import tempfile
import time

import numpy as np

from scripts.benchmarks._abab import (
    LocalSide,
    Worker,
    alternate,
    fmt_spread,
    progress,
    strip_outputs,
)
from scripts.benchmarks._checkpoint import write_demo_checkpoint, write_random_checkpoint
from scripts.benchmarks._env import env_checkout, env_choices, env_int, torch_worker_env

CONFIGS = ("demo", "tiny", "medium")
TASKS = ("rolling", "choice", "short")
MAX_LEN = 512  # our longest window: the tasks' sequences are at most 257 tokens
PLAIN = {"pack": False, "share_contexts": False}
UNITS = {"rolling": ("tokens", "tok/s"), "choice": ("requests", "pairs/s"),
         "short": ("requests", "rec/s")}
SMALL = {"medium"}  # configs whose defaults are sized for minutes, not hours, on 2 cores


@dataclasses.dataclass(frozen=True)
class Settings:
    configs: tuple[str, ...] = ("demo", "medium")
    tasks: tuple[str, ...] | None = None  # None: every task, rolling only on medium
    windows: int | None = None  # None: 16
    window: int = 256
    contexts: int | None = None  # None: 48, 4 on medium
    records: int | None = None  # None: 10000, 48 on medium
    hf_rows: int = 16
    reps: int = 3
    warmup: int = 1
    lm_eval: bool = True
    cli: bool = True
    timeout_s: int = 1800
    torch_env: dict = dataclasses.field(default_factory=dict)  # the transformers worker's
    baseline: str | None = None  # a checkout whose ninfer_jax runs as the `baseline` side

    @classmethod
    def from_env(cls) -> Settings:
        d = cls()
        tasks = env_choices("BENCH_SCORING_TASKS", (), TASKS)
        return cls(configs=env_choices("BENCH_SCORING_CONFIGS", d.configs, CONFIGS),
                   tasks=tasks or None,
                   windows=env_int("BENCH_SCORING_WINDOWS", 0, minimum=1) or None,
                   window=env_int("BENCH_SCORING_WINDOW", d.window, minimum=2),
                   contexts=env_int("BENCH_SCORING_CONTEXTS", 0, minimum=1) or None,
                   records=env_int("BENCH_SCORING_RECORDS", 0, minimum=1) or None,
                   hf_rows=env_int("BENCH_SCORING_HF_ROWS", d.hf_rows),
                   reps=env_int("BENCH_SCORING_REPS", d.reps),
                   warmup=env_int("BENCH_SCORING_WARMUP", d.warmup, minimum=0),
                   lm_eval=bool(env_int("BENCH_SCORING_LM_EVAL", 1, minimum=0, maximum=1)),
                   cli=bool(env_int("BENCH_SCORING_CLI", 1, minimum=0, maximum=1)),
                   timeout_s=env_int("BENCH_TIMEOUT_S", d.timeout_s),
                   torch_env=torch_worker_env(), baseline=env_checkout("BENCH_SCORING_BASELINE"))

    def tasks_of(self, config: str) -> tuple[str, ...]:
        if self.tasks is not None:
            return self.tasks
        return ("rolling",) if config in SMALL else TASKS


def _commit(checkout: str) -> str:
    import subprocess

    done = subprocess.run(["git", "-C", checkout, "log", "-1", "--format=%h %cs"],
                          capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


def task_requests(task: str, s: Settings, config: str, vocab: int, seed: int = 0
                  ) -> tuple[list[list[int]], list[int]]:
    """(sequences, index of each one's first scored token) of one task."""
    rng = np.random.default_rng(seed)
    small = config in SMALL
    if task == "rolling":  # one full call of our default shape: 16 rows of 256
        n = s.windows or 16
        return rng.integers(0, vocab, (n, s.window + 1)).tolist(), [1] * n
    seqs, firsts = [], []
    if task == "choice":
        for _ in range(s.contexts or (4 if small else 48)):
            context = rng.integers(0, vocab, int(rng.integers(140, 170))).tolist()
            for _ in range(4):
                seqs.append(context + rng.integers(0, vocab, int(rng.integers(10, 22))).tolist())
                firsts.append(len(context))
        return seqs, firsts
    n = s.records or (48 if small else 10000)
    return [rng.integers(0, vocab, int(rng.integers(20, 81))).tolist() for _ in range(n)], [1] * n


def _agreement(a: dict, b: dict) -> dict:
    la, lb = np.asarray(a["logprobs"]), np.asarray(b["logprobs"])
    return {"logprob_rel_err": float(np.abs(la - lb).max() / np.abs(lb).max()),
            "greedy_flags_agree": float((np.asarray(a["is_greedy"]) ==
                                         np.asarray(b["is_greedy"])).mean())}


def measure(name: str, s: Settings, workdir: pathlib.Path) -> dict:
    path = workdir / name
    info = write_demo_checkpoint(path) if name == "demo" else write_random_checkpoint(name, path)
    tasks = s.tasks_of(name)
    timeouts = {"setup_timeout_s": 2 * s.timeout_s, "timeout_s": s.timeout_s}
    out = {"config": name, **info, "hf_rows": s.hf_rows, "setup": {}, "tasks": {}}
    needs_plain = any(t != "rolling" for t in tasks)
    with contextlib.ExitStack() as stack:
        hf = stack.enter_context(Worker("transformers", "scripts.benchmarks.workers.scoring_hf",
                                        env=s.torch_env, **timeouts))
        ours = stack.enter_context(Worker("ours", "scripts.benchmarks.workers.scoring_jax",
                                          **timeouts))
        plain = stack.enter_context(Worker("ours_plain", "scripts.benchmarks.workers.scoring_jax",
                                           **timeouts)) if needs_plain else None
        base = stack.enter_context(Worker("baseline", "scripts.benchmarks.workers.scoring_jax",
                                          **timeouts)) if s.baseline else None
        floor = stack.enter_context(Worker(
            "matmul_floor", "scripts.benchmarks.workers.scoring_floor", **timeouts)
        ) if "rolling" in tasks else None
        config = {"max_len": MAX_LEN}
        if base is not None:
            out["baseline"] = {"code": s.baseline, "commit": _commit(s.baseline)}
        for w, args in ((hf, {"path": str(path), "rows": s.hf_rows}),
                        (ours, {"path": str(path), "config": config}),
                        (plain, {"path": str(path), "config": {**config, **PLAIN}}),
                        (base, {"path": str(path), "config": config, "code": s.baseline}),
                        (floor, {"path": str(path)})):
            if w is not None:
                progress(f"{name}: set-up of {w.name}")
                out["setup"][w.name] = {**w.setup(args), "wall_s": w.setup_s}
        out["setup"]["transformers"]["env"] = s.torch_env
        for task in tasks:
            seqs, firsts = task_requests(task, s, name, info["vocab_size"])
            rolling = task == "rolling"
            sides = [w for w in (ours, None if rolling else plain, base, hf, floor if rolling
                                 else None) if w is not None]
            progress(f"{name}: {task}, {len(seqs)} sequences")
            r = alternate(sides, task, {"seqs": seqs, "firsts": firsts,
                                        "unit": UNITS[task][0]},
                          reps=s.reps, warmup=s.warmup)
            last = {n: r["sides"][n]["outputs"][-1] for n in r["sides"]}
            result = {"sequences": len(seqs), "tokens": sum(len(q) for q in seqs),
                      "targets": sum(len(q) - f for q, f in zip(seqs, firsts)),
                      "vs_transformers": _agreement(last["ours"], last["transformers"]),
                      "fill": {n: last[n]["fill"] for n in last if "fill" in last[n]}}
            if "ours_plain" in last:
                result["vs_plain"] = _agreement(last["ours"], last["ours_plain"])
            if "baseline" in last:
                result["vs_baseline"] = _agreement(last["ours"], last["baseline"])
            result["measurement"] = strip_outputs(r)
            out["tasks"][task] = result
    return out


def lm_eval_choice(workdir: pathlib.Path, docs: int = 100, reps: int = 3) -> dict:
    """lm-evaluation-harness `simple_evaluate` on a local four-way multiple-choice task over the
    demo model (TinyStories: a story's opening, its next words against three other stories'),
    through the adapter with shared contexts and packing and without, in turns in this process
    (both sides ours). Wall seconds per evaluation and the accuracy of each."""
    import lm_eval

    from ninfer_jax.gateway.lm_eval_adapter import local_choice_task

    stories = _stories(docs + 3)
    rng = np.random.default_rng(0)
    rows = []
    for i in range(docs):
        words = stories[i].split()
        cut = min(len(words) - 6, 120)
        others = [stories[j].split() for j in rng.choice(
            [k for k in range(len(stories)) if k != i], 3, replace=False)]
        choices = [" " + " ".join(words[cut : cut + 5])] + [
            " " + " ".join(o[min(len(o) - 6, 120) : min(len(o) - 6, 120) + 5]) for o in others]
        order = rng.permutation(4)
        rows.append({"q": " ".join(words[:cut]), "choices": [choices[k] for k in order],
                     "gold": int(np.argmax(order == 0))})
    manager = local_choice_task(workdir, "stories_mc", rows)

    class Evaluation:
        def __init__(self, **settings):
            from ninfer_jax.gateway.lm_eval_adapter import NinferLM

            self.lm = NinferLM(max_len=MAX_LEN, **settings)

        def prepare(self, name, args):
            return None

        def rep(self, name):
            start = time.perf_counter()
            r = lm_eval.simple_evaluate(model=self.lm, tasks=["stories_mc"], task_manager=manager,
                                        log_samples=False, verbosity="ERROR")
            seconds = time.perf_counter() - start
            return {"seconds": seconds, "work": docs,
                    "outputs": {"acc": r["results"]["stories_mc"]["acc,none"]}}

        def finish(self, name):
            return None

    sides = [LocalSide("ours", Evaluation()), LocalSide("ours_plain", Evaluation(**PLAIN))]
    r = alternate(sides, "lm_eval", {}, reps=reps, warmup=1)
    acc = {n: r["sides"][n]["outputs"][-1]["acc"] for n in r["sides"]}
    return {"docs": docs, "acc": acc, "measurement": strip_outputs(r)}


def cli_short(workdir: pathlib.Path, records: int = 10000, reps: int = 3) -> dict:
    """What a batch job's user sees: `ninfer score` on the demo model over `records` short
    records (token ids, 20-80 tokens), each turn a fresh process timed from its start to its
    exit, in turns: the defaults against the path before packing and shared contexts
    (`--pack=false --share_contexts=false --chunk_records=64`, the old default chunk). Records/s
    per turn, the job's own closing line, and the largest difference between the two outputs'
    sums."""
    import json
    import subprocess
    import sys

    rng = np.random.default_rng(0)
    src = workdir / "short.jsonl"
    src.write_text("".join(json.dumps({"text": rng.integers(0, 4096, int(n)).tolist()}) + "\n"
                           for n in rng.integers(20, 81, records)))
    cli = [sys.executable, "-c", "from ninfer_jax.gateway.cli import run; run()", "score",
           f"--input={src}", "--max_len=512"]

    class Job:
        def __init__(self, name: str, flags: list[str]):
            self.name, self.flags, self.out, self.log = name, flags, workdir / f"{name}.jsonl", ""

        def prepare(self, name, args):
            return None

        def rep(self, name):
            for path in workdir.glob(f"{self.name}.jsonl*"):
                path.unlink()
            start = time.perf_counter()
            done = subprocess.run([*cli, f"--output={self.out}", *self.flags],
                                  capture_output=True, text=True, timeout=3600, check=False)
            seconds = time.perf_counter() - start
            if done.returncode:
                raise RuntimeError(f"{self.name}: {done.stderr[-2000:]}")
            self.log = [x for x in done.stderr.splitlines() if x.startswith("[ninfer]")][-1]
            sums = [json.loads(x)["sum_logprob"] for x in self.out.read_text().splitlines()]
            return {"seconds": seconds, "work": records,
                    "outputs": {"sums": sums, "log": self.log}}

        def finish(self, name):
            return None

    sides = [Job("ours", []), Job("ours_plain", ["--pack=false", "--share_contexts=false",
                                                 "--chunk_records=64"])]
    r = alternate(sides, "cli_short", {}, reps=reps, warmup=1)
    a, b = (np.array(r["sides"][n]["outputs"][-1]["sums"]) for n in ("ours", "ours_plain"))
    return {"records": records, "max_sum_rel_err": float(np.abs(a - b).max() / np.abs(b).max()),
            "logs": {n: r["sides"][n]["outputs"][-1]["log"] for n in r["sides"]},
            "measurement": strip_outputs(r)}


def _stories(n: int) -> list[str]:
    data = pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data" / \
        "tinystories" / "valid_head_cased.txt"
    lines = [x for x in data.read_text(encoding="utf-8").splitlines() if len(x.split()) > 30]
    return lines[:n]


def format_table(results: list[dict], lm: dict | None = None, cli: dict | None = None) -> str:
    lines = [(f"{'config':<8}{'task':<9}{'work':>14}  {'ours':>30}  {'ours_plain':>30}  "
              f"{'transformers':>30}{'ours/plain':>18}{'ours/hf':>18}{'fill':>10}"
              f"{'err hf':>9}{'err plain':>10}{'load 1-min':>12}")]
    based = [r for r in results if "baseline" in r]
    for r in results:
        for task, t in r["tasks"].items():
            m = t["measurement"]
            sides, ratios, load = m["sides"], m["ratios"], m["load_1min"]
            unit = UNITS[task][1]

            def rate(n, sides=sides, unit=unit):
                return f"{fmt_spread(sides[n]['rate'])} {unit}" if n in sides else "-"

            def ratio(n, ratios=ratios):
                key = f"ours/{n}"
                return fmt_spread(ratios[key], 2) if key in ratios else "-"

            fill = t["fill"]
            fills = f"{fill['ours']:.0%}" + (f"/{fill['ours_plain']:.0%}"
                                             if "ours_plain" in fill else "")
            plain_err = f"{t['vs_plain']['logprob_rel_err']:.1e}" if "vs_plain" in t else "-"
            lines.append(
                f"{r['config']:<8}{task:<9}{t['sequences']:>6} x {t['targets'] // t['sequences']:<5}"
                f"  {rate('ours'):>30}  {rate('ours_plain'):>30}  {rate('transformers'):>30}"
                f"{ratio('ours_plain'):>18}{ratio('transformers'):>18}{fills:>10}"
                f"{t['vs_transformers']['logprob_rel_err']:>9.1e}{plain_err:>10}"
                f"{load['min']:>6.1f}-{load['max']:<5.1f}")
    for r in results:
        t = r["tasks"].get("rolling")
        if t and "matmul_floor" in t["measurement"]["sides"]:
            rates = {n: v["rate"]["median"] for n, v in t["measurement"]["sides"].items()}
            floor = rates["matmul_floor"]
            lines.append(f"{r['config']} rolling: matmul floor {floor:,.1f} tok/s (every weight "
                         f"and the head as XLA dots, nothing else); ours at "
                         f"{rates['ours'] / floor:.2f} of it, transformers at "
                         f"{rates['transformers'] / floor:.2f}; 1.5x transformers would be "
                         f"{1.5 * rates['transformers'] / floor:.2f} of it")
    for r in based:
        lines.append(f"{r['config']}: baseline = {r['baseline']['commit']} "
                     f"({r['baseline']['code']}), its defaults")
        for task, t in r["tasks"].items():
            m = t["measurement"]
            lines.append(f"  {task:<8} baseline {fmt_spread(m['sides']['baseline']['rate'])} "
                         f"{UNITS[task][1]}, ours/baseline "
                         f"{fmt_spread(m['ratios']['ours/baseline'], 2)}, err "
                         f"{t['vs_baseline']['logprob_rel_err']:.1e}, greedy flags agree "
                         f"{t['vs_baseline']['greedy_flags_agree']:.4f}")
    for r in results:
        su = r["setup"]
        lines.append(f"{r['config']} ({r['num_params'] / 1e6:.1f}M params) set-up: ours "
                     f"{su['ours']['wall_s']:.1f} s ({su['ours']['executables']} executables), "
                     f"transformers {su['transformers']['wall_s']:.1f} s "
                     f"({su['transformers']['threads']} torch threads, batches of {r['hf_rows']})")
    if lm:
        m = lm["measurement"]
        lines.append(f"lm-eval simple_evaluate, {lm['docs']} four-way docs on demo: ours "
                     f"{fmt_spread(m['sides']['ours']['seconds'], 2)} s, ours_plain "
                     f"{fmt_spread(m['sides']['ours_plain']['seconds'], 2)} s, ours/plain "
                     f"{fmt_spread(m['ratios']['ours/ours_plain'], 2)} (docs/s), acc "
                     f"{lm['acc']['ours']:.3f} vs {lm['acc']['ours_plain']:.3f}")
    if cli:
        m = cli["measurement"]
        lines.append(f"ninfer score, {cli['records']} short records on demo, fresh process per "
                     f"turn: ours {fmt_spread(m['sides']['ours']['rate'])} rec/s, ours_plain "
                     f"(old defaults) {fmt_spread(m['sides']['ours_plain']['rate'])} rec/s, "
                     f"ours/plain {fmt_spread(m['ratios']['ours/ours_plain'], 2)}, sums rel err "
                     f"{cli['max_sum_rel_err']:.1e}")
        for name, log in cli["logs"].items():
            lines.append(f"  {name}: {log}")
    lines.append("rates: median [min-max] over the repetitions; ratios per round; fill: real "
                 "tokens per input position of our calls (ours/ours_plain); err: max log-prob "
                 "error relative to the largest |log-prob|")
    return "\n".join(lines)


def run(out_dir: str) -> dict:
    del out_dir  # bench.py writes the JSON; the table is printed
    s = Settings.from_env()
    start = time.perf_counter()
    progress(f"settings {s}")
    with tempfile.TemporaryDirectory(prefix="ninfer_bench_scoring_") as tmp:
        results = [measure(name, s, pathlib.Path(tmp)) for name in s.configs]
        lm = cli = None
        if s.lm_eval:
            progress("demo: lm-eval simple_evaluate, shared and plain")
            lm = lm_eval_choice(pathlib.Path(tmp), reps=s.reps)
        if s.cli:
            progress("demo: ninfer score on short records, default and plain")
            cli = cli_short(pathlib.Path(tmp), s.records or 10000, reps=s.reps)
    table = format_table(results, lm, cli)
    print(table)
    return {"settings": dataclasses.asdict(s), "results": results, "lm_eval": lm, "cli": cli,
            "cpu_count": os.cpu_count(), "wall_s": time.perf_counter() - start, "table": table}
