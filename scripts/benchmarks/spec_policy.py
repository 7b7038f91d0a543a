"""The draft policy against fixed K and no speculation, through the Engine, on the embedded model.

    python scripts/bench.py --suite=spec_policy --out=DIR
    BENCH_SPECPOL_METHOD=dflash python scripts/bench.py --suite=spec_policy --out=DIR

One method per run. The sides are Engines over Programs of the demo model (max_concurrency 4,
every executable compiled before the first turn), each in its own long-lived process
(`workers/spec_engine.py`: in one process the Engines' idle workers and caches disturbed each
other's rounds), taking turns: "off" (no speculation), "policy" (`draft_policy="adaptive"`, K =
the largest of BENCH_SPECPOL_KS: each round's K, 0 included, chosen from what that Engine
measured), "K=k" (`draft_policy="fixed"`: every round drafts k) for each k of them and
"policy:off" (the policy's Engine, in its process, serving requests with speculative="off":
rounds of 0, bare ones where it has them; `RequestsOff`), each round of turns starting one side
later (`alternate(rotate=True)`: every side in every place equally often, none twice in a row;
the serpentine order used until 2026-12-07 ran its end sides, "off" among them, twice in a row
at its turnarounds). A process has a speed of its own: two of the same code ran 0.92-1.07x apart
(medians over 15 turns, docs/speculative.md), so with BENCH_SPECPOL_REPLICAS=N "off", "policy"
and each fixed K run as N processes each and the targets are on the ratios pooled over every
pair of them (with one process a fixed K, its luck was the best fixed K's: the demo's DFlash at
B = 4, 2026-12-07, the one K = 4 process ran 1.07x the four off processes' mean and the policy
0.88 of it, where policy / off was 0.98 and K = 4 / off 1.01 in their own turns). The best fixed
K is the one whose processes ran the most over off, pooled. A turn submits the first B story
prompts of `_engine_vs_program.py` together, greedy, `ignore_eos`, NEW_TOKENS each. A thread a
request is its client: it reads events until the first token arrives, then waits for the end.
Two rates a turn: the decode tok/s (each request's tokens after its first over the seconds from
its first to its end, summed over the requests: what the targets are on) and the turn's tok/s
(B * NEW_TOKENS from the submit to the last end: the prompts' prefills too, which are not the same
on every side: a speculative Program's prefill also fills the drafter's context, the demo's
DFlash 4 short prompts 45.0 ms against 41.6 without); and the last request's first token from
the submit. Each Engine lives through all turns, as a server does: the policy's measurements
carry from one request to the next (its first requests, the warm-up turns, explore every K).

Reported per B: each side's decode tok/s and turn tok/s (median [min-max] over turns), their ratios
to "off" per turn pair, the first token's ratio, "policy" over "policy:off" per turn pair (what its
choices did: the same process, so a process's own speed is on both sides) and "policy:off" over
"off" (what an Engine opened with speculation costs a request that drafts nothing, a process's speed
included), each fixed K over "off" and "policy" over the best fixed K per turn pair, whether every
side's tokens equal "off"'s, the policy's rounds by K (in all and per turn) and its round times by K
after each turn (in the output, `policy_replica_turns`: for every policy process, its rounds by K
and by (K, B) per turn too), and the 1-minute load average. Then the upkeep: the same Programs
driven directly (their Engines stopped), ms per round of 0 drafts of the policy's Program (plain
decode plus the drafter's upkeep) against "off"'s plain decode, in turn; and of its bare round of 0
(the upkeep skipped, `HostProgram.decode(bare=True)`) where it has one. The policy's bare rounds are
counted per turn. Targets ([spec-policy], on decode tok/s): policy >= 0.97x off and >= 0.9x the best
fixed K at every B (whether the turn's tok/s meets them too is reported beside).

Settings (environment): BENCH_SPECPOL_METHOD=mtp (or dflash)  BENCH_SPECPOL_KS (mtp: 1,2,3;
dflash: 4,8,15)  BENCH_SPECPOL_BATCHES=1,4  BENCH_SPECPOL_NEW_TOKENS=128  BENCH_SPECPOL_REPS=5
BENCH_SPECPOL_WARMUP=2  BENCH_SPECPOL_REPLICAS=1 (processes of "off", of "policy" and of each
fixed K, "off 2", "policy 2", "K=4 2", ...: the targets are then on every policy process over
every off process, and over every process of the best fixed K, per turn, and how far the same
code's processes ran apart is reported; the demo's DFlash at 4 replicas: ~20 GB resident, a
policy process ~2 GB, a fixed K ~0.75 GB, off ~0.5 GB)  BENCH_SPECPOL_BASELINE=DIR (a
checkout of an earlier commit, `git worktree add DIR COMMIT`: its "off" and "policy" Engines
join the turns as the sides "base off" and "base policy", and "off" and "policy" over them per
pair are reported: a change to the Program, the Engine or the policy measured in the same
turns).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

from scripts.benchmarks._abab import Worker, alternate, fmt_spread, progress, spread
from scripts.benchmarks._engine_vs_program import PROMPTS
from scripts.benchmarks._env import SettingError, env_checkout, env_int, env_ints

TARGET_OVER_OFF = 0.97
TARGET_OVER_BEST = 0.9
DEFAULT_KS = {"mtp": (1, 2, 3), "dflash": (4, 8, 15)}


@dataclasses.dataclass(frozen=True)
class Settings:
    method: str = "mtp"
    ks: tuple[int, ...] = (1, 2, 3)
    batches: tuple[int, ...] = (1, 4)
    new_tokens: int = 128
    reps: int = 5
    warmup: int = 2
    baseline: str | None = None
    replicas: int = 1

    @classmethod
    def from_env(cls) -> Settings:
        from ninfer_jax.program.config import MAX_SPECULATIVE_TOKENS

        method = os.environ.get("BENCH_SPECPOL_METHOD", "mtp")
        if method not in DEFAULT_KS:
            raise SettingError(f"BENCH_SPECPOL_METHOD must be one of {list(DEFAULT_KS)}, got "
                               f"{method!r:.40}")
        d = cls()
        return cls(method=method,
                   ks=env_ints("BENCH_SPECPOL_KS", DEFAULT_KS[method], minimum=1,
                               maximum=MAX_SPECULATIVE_TOKENS[method]),
                   batches=env_ints("BENCH_SPECPOL_BATCHES", d.batches, maximum=4),
                   new_tokens=env_int("BENCH_SPECPOL_NEW_TOKENS", d.new_tokens, minimum=2,
                                      maximum=1024),
                   reps=env_int("BENCH_SPECPOL_REPS", d.reps),
                   warmup=env_int("BENCH_SPECPOL_WARMUP", d.warmup, minimum=0),
                   baseline=env_checkout("BENCH_SPECPOL_BASELINE"),
                   replicas=env_int("BENCH_SPECPOL_REPLICAS", d.replicas, minimum=1,
                                    maximum=4))


UPKEEP_ROUNDS = 200  # rounds of 0 drafts per upkeep turn, at most
UPKEEP_TOKENS = 1800  # the most a sequence decodes over all upkeep turns (max_seq_len 2048)


def _settings(s: Settings, k: int, policy: str) -> dict:
    spec = {} if k == 0 else {"speculative": s.method, "num_speculative_tokens": k,
                              "draft_policy": policy}
    return {"max_concurrency": max(s.batches), **spec}


def _replicas(s: Settings, name: str) -> list[str]:
    """The processes of side `name` ("off", "policy" or "K=k"): itself, then "<name> 2", ..."""
    return [name] + [f"{name} {r}" for r in range(2, s.replicas + 1)]


def _sides(s: Settings) -> list[tuple[str, int, str]]:
    """(name, K, draft_policy) of every process, in the order they start and take turns."""
    return [("off", 0, "fixed"), ("policy", max(s.ks), "adaptive"),
            *((f"K={k}", k, "fixed") for k in s.ks),
            *((name, k, policy) for r in range(2, s.replicas + 1)
              for name, k, policy in ((f"off {r}", 0, "fixed"),
                                      (f"policy {r}", max(s.ks), "adaptive"),
                                      *((f"K={k} {r}", k, "fixed") for k in s.ks))),
            *([("base off", 0, "fixed"), ("base policy", max(s.ks), "adaptive")]
              if s.baseline else [])]


def measure(s: Settings) -> dict:
    sides = _sides(s)
    offs, policies = _replicas(s, "off"), _replicas(s, "policy")
    out = {"setup": {}, "batches": {}, "upkeep": {}, "upkeep_bare": {}}
    fixed = {f"K={k}": _replicas(s, f"K={k}") for k in s.ks}  # each K's processes
    with contextlib.ExitStack() as stack:
        workers = {}
        for name, k, policy in sides:
            progress(f"starting {name} ({s.method}; compiling every executable)")
            w = stack.enter_context(Worker(name, "scripts.benchmarks.workers.spec_engine"))
            code = s.baseline if name.startswith("base ") else None
            out["setup"][name] = w.setup({"settings": _settings(s, k, policy), "code": code})
            workers[name] = w
        ordered = [workers[name] for name, _, _ in sides]
        ordered += [RequestsOff(workers[name]) for name in policies]
        for b in s.batches:
            progress(f"B={b}: {[n for n, _, _ in sides]} in turn")
            r = alternate(ordered, f"b{b}", {"prompts": list(PROMPTS[:b]),
                                            "new_tokens": s.new_tokens},
                          reps=s.reps, warmup=s.warmup, rotate=True)
            off = r["sides"]["off"]
            reference = off["outputs"][0]["tokens"]
            row = {"order": r["order"], "load_1min": r["load_1min"], "sides": {}}
            decode = {n: _outputs(v, "decode_tok_s") for n, v in r["sides"].items()}
            first = {n: _outputs(v, "first_token_ms") for n, v in r["sides"].items()}
            for name in r["sides"]:
                side = r["sides"][name]
                row["sides"][name] = {
                    "decode_tok_s": spread(decode[name]), "decode_rates": decode[name],
                    "decode_over_off": _over(decode[name], decode["off"]),
                    "tok_s": side["rate"], "rates": side["rates"],
                    "over_off": _over(side["rates"], off["rates"]),
                    "first_token_ms": spread(first[name]),
                    "first_token_over_off": _over(first[name], first["off"]),
                    "worker_cpu_ms_per_round": spread(_outputs(side, "worker_cpu_ms_per_round")),
                    "same_tokens_as_off": all(o["tokens"] == reference for o in
                                              side["warmup_outputs"] + side["outputs"])}
            # each fixed K over off, pooled over their processes; the best by that
            fixed_over_off = {k: _pooled(decode, names, offs) for k, names in fixed.items()}
            best = max(fixed, key=lambda k: fixed_over_off[k]["median"])
            pol = r["sides"]["policy"]["rates"]
            turns = {n: v["rates"] for n, v in r["sides"].items()}
            over_off = _pooled(decode, policies, offs)
            over_best = _pooled(decode, policies, fixed[best])
            turn_over_off = _pooled(turns, policies, offs)
            turn_over_best = _pooled(turns, policies, fixed[best])
            row["policy"] = {
                "best_fixed": best, "replicas": s.replicas,
                "fixed_over_off": fixed_over_off, "decode_over_off": over_off,
                "decode_over_best_fixed": over_best, "over_off": turn_over_off,
                "over_best_fixed": turn_over_best, "met": _met(over_off, over_best),
                "turn_met": _met(turn_over_off, turn_over_best)}
            # The policy's process serving requests that draft nothing: its choices apart
            # from its process's speed (same process), and that speed apart from them
            own = [f"{n}:off" for n in policies]
            row["policy"]["decode_over_own_off"] = spread(
                [x / y for n in policies for x, y in zip(decode[n], decode[f"{n}:off"])])
            row["policy"]["own_off_over_off"] = _pooled(decode, own, offs)
            if s.replicas > 1:  # the same code in two processes: how far apart they run
                row["replica_spread"] = {
                    "off": _pooled(decode, offs[1:], offs[:1]),
                    "policy": _pooled(decode, policies[1:], policies[:1])}
            if s.baseline:
                row["off_over_base"] = _over(off["rates"], r["sides"]["base off"]["rates"])
                row["policy_over_base"] = _over(pol, r["sides"]["base policy"]["rates"])
            row["policy_rounds_by_turn"] = _rounds_by_turn(r["sides"]["policy"])
            row["policy_bare_by_turn"] = _bare_by_turn(r["sides"]["policy"])
            row["policy_round_ms_by_turn"] = _round_ms_by_turn(r["sides"]["policy"], b)
            # the same for every policy process (each learns on its own), by (K, B) too
            row["policy_replica_turns"] = {n: {
                "rounds_by_turn": _rounds_by_turn(r["sides"][n]),
                "rounds_by_kb_by_turn": [o["rounds_by_kb"] for o in r["sides"][n]["outputs"]],
                "bare_by_turn": _bare_by_turn(r["sides"][n]),
                "round_ms_by_turn": _round_ms_by_turn(r["sides"][n], b)} for n in policies}
            out["batches"][b] = row
            out["policy_stats"] = r["sides"]["policy"]["outputs"][-1]["stats"]
        # The upkeep: rounds of 0 drafts at the Program, off's plain decode and the policy's
        # Program (plain decode plus the drafter's upkeep) in turn; the Engines stop first.
        pair = [workers["off"], workers["policy"]]
        rounds = min(UPKEEP_ROUNDS, UPKEEP_TOKENS // (s.reps + s.warmup))
        budget = rounds * (s.reps + s.warmup) + 2
        bare = out["setup"]["policy"].get("bare_window", 0) > 0
        for b in s.batches:
            for kind in ("upkeep", "upkeep_bare") if bare else ("upkeep",):
                progress(f"{kind}: B={b}, rounds of 0 drafts, off and {s.method} in turn")
                r = alternate(pair, f"{kind}_b{b}", {
                    "prompts": list(PROMPTS[:b]), "budget": budget, "rounds": rounds,
                    "bare": kind == "upkeep_bare"}, reps=s.reps, warmup=s.warmup)
                rates = {n: r["sides"][n]["rates"] for n in r["sides"]}
                out[kind][b] = {
                    "round_ms": {n: spread([1000 / x for x in v]) for n, v in rates.items()},
                    "over_off": spread([x / y for x, y in zip(rates["off"], rates["policy"])])}
    return out


class RequestsOff:
    """Side "<policy>:off": the policy's Engine (the same process) serving requests with
    `SamplingParams(speculative="off")`, which draft nothing (rounds of 0, bare where the
    Program has them). Over it, the policy per turn pair is what the policy's choices did, a
    process's own speed aside; it over "off" is what an Engine opened with speculation costs
    a request that does not draft."""

    def __init__(self, worker: Worker):
        self.name, self._worker = f"{worker.name}:off", worker

    def prepare(self, name: str, args: dict):
        return self._worker.prepare(f"{name}:off", {**args, "speculative": "off"})

    def rep(self, name: str) -> dict:
        return self._worker.rep(f"{name}:off")

    def finish(self, name: str):
        return self._worker.finish(f"{name}:off")


def _outputs(side: dict, key: str) -> list[float]:
    return [o[key] for o in side["outputs"]]


def _over(xs: list[float], ys: list[float]) -> dict:
    """x / y per turn pair, as a spread."""
    return spread([x / y for x, y in zip(xs, ys)])


def _pooled(rates: dict[str, list[float]], tops: list[str], bottoms: list[str]) -> dict:
    """x / y per turn for every side x of `tops` and y of `bottoms` (the same turn), as one
    spread: with replicas, what each process of a side runs more or less than another of the
    same code (a process's own speed: two of the same code ran 0.92-1.07x apart, medians of
    15 turns) weighs equally on both sides of the ratio."""
    return spread([x / y for top in tops for bottom in bottoms
                   for x, y in zip(rates[top], rates[bottom])])


def _met(over_off: dict, over_best: dict) -> bool:
    return over_off["median"] >= TARGET_OVER_OFF and over_best["median"] >= TARGET_OVER_BEST


def _rounds_by_turn(side: dict) -> list[dict[int, int]]:
    """The policy's decode rounds by K in each measured turn (its Engine's counts over the
    turn: a turn runs one B)."""
    return [o["rounds_by_drafts"] for o in side["outputs"]]


def _round_ms_by_turn(side: dict, b: int) -> list[dict[int, float]]:
    """The policy's round time by K at B after each measured turn (what its next choices
    start from: `SpeculativeStats.round_ms`)."""
    return [{k: ms for k, at, ms in o["stats"]["round_ms"] if at == b} for o in side["outputs"]]


def _bare_by_turn(side: dict) -> list[int]:
    """The policy's bare rounds of 0 in each measured turn."""
    return [o["bare_rounds"] for o in side["outputs"]]


def format_table(result: dict) -> str:
    s, m = result["settings"], result["measure"]
    lines = [(f"{s['method']} on the embedded model, through the Engine: {s['new_tokens']} "
              f"greedy tokens per request, B requests together, {s['warmup']} warm-up + "
              f"{s['reps']} turns per side in turn"),
             (f"{'B':>3}{'side':>14}{'decode tok/s':>24}{'/off per pair':>20}"
              f"{'turn tok/s':>24}{'/off per pair':>20}{'first token /off':>20}"
              f"{'same as off':>13}{'worker CPU ms/round':>24}")]
    for b, row in m["batches"].items():
        for name, v in row["sides"].items():
            cpu = v.get("worker_cpu_ms_per_round")
            lines.append(f"{b:>3}{name:>14}{fmt_spread(v['decode_tok_s']):>24}"
                         f"{fmt_spread(v['decode_over_off'], 2):>20}"
                         f"{fmt_spread(v['tok_s']):>24}{fmt_spread(v['over_off'], 2):>20}"
                         f"{fmt_spread(v['first_token_over_off'], 2):>20}"
                         f"{'yes' if v['same_tokens_as_off'] else 'NO':>13}"
                         f"{fmt_spread(cpu, 3) if cpu else '':>24}")
        p, load = row["policy"], row["load_1min"]
        pooled = f" (pooled over {p['replicas']} processes a side)" if \
            p.get("replicas", 1) > 1 else ""
        if pooled:
            lines.append(f"    policy / off per pair{pooled}: decode "
                         f"{fmt_spread(p['decode_over_off'], 2)}, turn "
                         f"{fmt_spread(p['over_off'], 2)}; the same code's processes apart, "
                         f"decode per pair: off {fmt_spread(row['replica_spread']['off'], 3)}"
                         f", policy {fmt_spread(row['replica_spread']['policy'], 3)}")
        if "decode_over_own_off" in p:
            lines.append(f"    policy / its own process's speculative=\"off\" requests per "
                         f"pair (the same process): decode "
                         f"{fmt_spread(p['decode_over_own_off'], 2)}; those requests / off per "
                         f"pair: decode {fmt_spread(p['own_off_over_off'], 2)}")
        if "fixed_over_off" in p:
            lines.append(f"    fixed K / off per pair{pooled}: decode " + ", ".join(
                f"{k} {fmt_spread(v, 2)}" for k, v in p["fixed_over_off"].items()))
        lines.append(f"    policy / best fixed ({p['best_fixed']}) per pair{pooled}: decode "
                     f"{fmt_spread(p['decode_over_best_fixed'], 2)}, turn "
                     f"{fmt_spread(p['over_best_fixed'], 2)}; target on decode tok/s >= "
                     f"{TARGET_OVER_OFF}x off and >= {TARGET_OVER_BEST}x best fixed: "
                     f"{'met' if p['met'] else 'NOT met'} (on the turn's tok/s: "
                     f"{'met' if p['turn_met'] else 'not met'}); load 1-min {load}")
        turns = row.get("policy_rounds_by_turn", [])
        lines.append("    policy rounds by K per turn: " + "; ".join(
            " ".join(f"{k}:{n}" for k, n in sorted(t.items(), key=lambda x: int(x[0])))
            for t in turns))
        if any(row.get("policy_bare_by_turn", ())):
            lines.append("    of them bare rounds of 0 per turn: " + " ".join(
                str(n) for n in row["policy_bare_by_turn"]))
        if "off_over_base" in row:
            lines.append(f"    off / base off ({s['baseline']}) per pair: "
                         f"{fmt_spread(row['off_over_base'], 3)}")
        if "policy_over_base" in row:
            lines.append(f"    policy / base policy per pair: "
                         f"{fmt_spread(row['policy_over_base'], 3)}")
    for kind, what in (("upkeep", "a round of 0 drafts"), ("upkeep_bare", "a bare round of 0")):
        for b, u in m.get(kind, {}).items():
            lines.append(f"upkeep at the Program, B={b}: {what} "
                         f"{fmt_spread(u['round_ms']['policy'], 3)} ms ({s['method']}) against "
                         f"{fmt_spread(u['round_ms']['off'], 3)} ms (off): "
                         f"{fmt_spread(u['over_off'], 2)}x its time per pair")
    st = m["policy_stats"]
    lines.append(f"policy rounds by K {dict(st['rounds_by_drafts'])}; acceptance by position "
                 f"{[round(a, 2) for a in st['acceptance_by_position']]}; round ms "
                 f"(K, B, ms) {list(st['round_ms'])}")
    return "\n".join(lines)


def run(out_dir: str) -> dict:
    del out_dir  # bench.py writes the JSON; the table is printed
    import jax

    s = Settings.from_env()
    start, load_start = time.perf_counter(), os.getloadavg()
    progress(f"settings {s}")
    result = {"settings": dataclasses.asdict(s), "date": time.strftime("%Y-%m-%d %H:%M"),
              "jax": jax.__version__, "cpu_count": os.cpu_count(), "measure": measure(s)}
    result.update(load_average_start=load_start, load_average_end=os.getloadavg(),
                  wall_s=time.perf_counter() - start)
    result["table"] = format_table(result)
    print(result["table"])
    return result
