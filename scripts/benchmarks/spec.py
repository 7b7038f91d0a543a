"""MTP and DFlash speculative decoding against plain decoding, on the Program, in one process.

    python scripts/bench.py --suite=spec --out=DIR

Every side is ours, so all share one process (`_abab.LocalSide`) and take turns, one Program
per variant ("K=0": speculation off; "K=k": `speculative="mtp"` with k drafts a round;
"dflash K=k": the embedded model's shipped DFlash2 drafter proposing k a round), each with
every exact B compiled at start-up (`wait_compiled`; the compile time is reported, never timed).

- demo: the embedded demo model (`load_model()`), in two groups of Programs (one process
  cannot keep all seven default variants mapped; see REPEAT): first K=0 and MTP's Ks, then
  K=0' and MTP's best K at B=1 (K=k') again with DFlash's Ks. Within a group, for each B in
  BATCHES, the variants take turns (K=0, K=1, ..., K=0, ...): a turn admits and prefills the
  first B story prompts of `_engine_vs_program.py` untimed, then times decode + commit rounds
  that commit every produced token until each row has NEW_TOKENS (greedy;
  `_spec_sides.GenerateSide`). Reported per (B, K): tok/s (tokens the timed rounds committed /
  seconds), the ratio to the group's K=0 per turn pair, the mean tokens committed per
  row-round, the acceptance of each draft position (row-rounds in which draft j was accepted /
  those whose limit let it be), whether every turn's tokens equal K=0's (greedy, so they
  must), and the 1-minute load average around the turns. Then the best K at B=1 and across B
  per method, the target best MTP K >= 1.5x K=0 at B=1, and DFlash's best K against MTP's per
  turn pair of the second group.
- medium (BENCH_SPEC_MEDIUM=1): MEDIUM with random fp32 weights and a one-layer MTP head
  (`init_params(..., num_mtp_layers=1)`, seed 0), K=0 against K=MEDIUM_K. B random 32-token
  prompts are admitted and prefilled once; a turn is MEDIUM_ROUNDS decode + commit rounds on
  all B rows, every row proposing the full K + 1 tokens (`_spec_sides.RoundSide`). Reported:
  ms per round of each side, the verify/decode ratio per turn pair, and the target: verify
  (K=3) <= 1.3x a decode step at B=1. Random drafts are rarely accepted, so the rounds measure
  the step, not a speed-up.

Settings (environment): BENCH_SPEC_KS=0,1,2,3 (MTP; must hold 0)  BENCH_SPEC_DFLASH_KS=4,8,15
(empty: none)  BENCH_SPEC_DRAFT_HEAD=full (or selector: DFlash's `ProgramConfig.draft_head`)  BENCH_SPEC_BATCHES=1,2,4,8
BENCH_SPEC_NEW_TOKENS=128  BENCH_SPEC_REPS=5  BENCH_SPEC_WARMUP=1  BENCH_SPEC_MEDIUM=1 (0 skips
it)  BENCH_SPEC_MEDIUM_K=3  BENCH_SPEC_MEDIUM_BATCHES=1,8  BENCH_SPEC_MEDIUM_ROUNDS=4
BENCH_SPEC_MEDIUM_REPS=5.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time

from ninfer_jax.program.config import MAX_SPECULATIVE_TOKENS
from scripts.benchmarks._abab import LocalSide, alternate, fmt_spread, progress, spread
from scripts.benchmarks._engine_vs_program import PROMPTS
from scripts.benchmarks._env import SettingError, env_int, env_ints
from scripts.benchmarks._spec_sides import (
    GenerateSide,
    RoundSide,
    build_program,
    merge_tallies,
    program_config,
)

MAX_K = MAX_SPECULATIVE_TOKENS["mtp"]
PROMPT_LEN = 32  # MEDIUM's random prompts
TARGET_DEMO_SPEEDUP = 1.5
TARGET_MEDIUM_VERIFY = 1.3


@dataclasses.dataclass(frozen=True)
class Settings:
    ks: tuple[int, ...] = (0, 1, 2, 3)
    dflash_ks: tuple[int, ...] = (4, 8, 15)
    draft_head: str = "full"
    batches: tuple[int, ...] = (1, 2, 4, 8)
    new_tokens: int = 128
    reps: int = 5
    warmup: int = 1
    medium: bool = True
    medium_k: int = 3
    medium_batches: tuple[int, ...] = (1, 8)
    medium_rounds: int = 4
    medium_reps: int = 5

    @classmethod
    def from_env(cls) -> Settings:
        d = cls()
        ks = env_ints("BENCH_SPEC_KS", d.ks, minimum=0, maximum=MAX_K)
        if 0 not in ks:
            raise SettingError(f"BENCH_SPEC_KS must hold 0 (the baseline every ratio divides "
                               f"by), got {os.environ['BENCH_SPEC_KS']!r:.60}")
        dflash = os.environ.get("BENCH_SPEC_DFLASH_KS")
        dflash_ks = () if dflash is not None and not dflash.strip() else env_ints(
            "BENCH_SPEC_DFLASH_KS", d.dflash_ks, maximum=MAX_SPECULATIVE_TOKENS["dflash"])
        return cls(
            ks=ks, dflash_ks=dflash_ks, draft_head=_draft_head(d.draft_head), batches=env_ints("BENCH_SPEC_BATCHES", d.batches, maximum=len(PROMPTS)),
            new_tokens=env_int("BENCH_SPEC_NEW_TOKENS", d.new_tokens, minimum=2, maximum=1024),
            reps=env_int("BENCH_SPEC_REPS", d.reps),
            warmup=env_int("BENCH_SPEC_WARMUP", d.warmup, minimum=0),
            medium=bool(env_int("BENCH_SPEC_MEDIUM", int(d.medium), minimum=0, maximum=1)),
            medium_k=env_int("BENCH_SPEC_MEDIUM_K", d.medium_k, maximum=MAX_K),
            medium_batches=env_ints("BENCH_SPEC_MEDIUM_BATCHES", d.medium_batches, maximum=8),
            medium_rounds=env_int("BENCH_SPEC_MEDIUM_ROUNDS", d.medium_rounds),
            medium_reps=env_int("BENCH_SPEC_MEDIUM_REPS", d.medium_reps))


def _draft_head(default: str) -> str:
    from ninfer_jax.program.config import DRAFT_HEADS

    value = os.environ.get("BENCH_SPEC_DRAFT_HEAD", default)
    if value not in DRAFT_HEADS:
        raise SettingError(f"BENCH_SPEC_DRAFT_HEAD must be one of {DRAFT_HEADS}, got "
                           f"{value!r:.60}")
    return value


def _per_pair(rates: list[float], base: list[float]) -> dict:
    return spread([x / y for x, y in zip(rates, base)])


def _side_loads(r: dict, side: str) -> dict:
    """The 1-minute load before and after each of one side's turns, and their range."""
    turns = [(x["before"][0], x["after"][0]) for x in r["load"] if x["side"] == side]
    return {"turns": turns, **spread([v for t in turns for v in t])}


def variants(s: Settings) -> list[tuple[str, str, int]]:
    """(side name, method, K) of every demo side: K=0 (off), MTP's Ks, DFlash's Ks."""
    return ([(f"K={k}", "mtp", k) for k in s.ks]
            + [(f"dflash K={k}", "dflash", k) for k in s.dflash_ks])


# What one demo Program at max_concurrency 8 keeps mapped (/proc/self/maps lines, measured
# 2026-12-02): K=0 about 4,500, an MTP K about 8,200, a DFlash K about 11,600. Linux refuses
# a process more than vm.max_map_count (65,530 by default): all seven default variants in one
# process (about 64,000) made LLVM fail to allocate and the process crash. So the demo part
# runs in two groups, each its Programs alive together and taking turns, the first freed
# before the second compiles: K=0 with MTP's Ks, then K=0 with MTP's best K at B=1 and
# DFlash's Ks (about 48,000), which compares DFlash with MTP turn by turn.
REPEAT = "'"  # the second group's K=0 and MTP sides: "K=0'", "K=1'"


def _maps() -> int | None:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:
        return None


def _measure_group(cfg, params, prompts, s: Settings, group, drafter, out: dict,
                   max_seq_len: int) -> None:
    """Builds `group`'s Programs ((name, method, K); the first is the K=0 baseline), lets them
    take turns at every B, adds their rows to out["batches"][B]["ks"], then frees them."""
    import gc

    import jax

    sides = []
    base_name = group[0][0]
    for name, method, k in group:
        progress(f"demo: compiling {name} (B = 1..{max(s.batches)}; {_maps()} maps)")
        pcfg = program_config(k, max(s.batches), max_seq_len, prefill_chunk=64, method=method,
                              draft_head=s.draft_head)
        program, out["compile"][name] = build_program(
            cfg, params, pcfg, drafter if method == "dflash" else None)
        sides.append(LocalSide(name, GenerateSide(program, k, s.new_tokens)))
    names = [g[0] for g in group]
    for b in s.batches:
        progress(f"demo: B={b}, {names} in turn")
        r = alternate(sides, f"b{b}", {"prompts": prompts[:b]}, reps=s.reps, warmup=s.warmup)
        base = r["sides"][base_name]
        reference = base["outputs"][0]["tokens"]
        row = out["batches"].setdefault(b, {"order": [], "wall_s": 0.0, "load_1min": [],
                                            "ks": {}})
        row["order"] += r["order"]
        row["wall_s"] += r["wall_s"]
        row["load_1min"].append(r["load_1min"])
        for name, _, k in group:
            side = r["sides"][name]
            runs = side["warmup_outputs"] + side["outputs"]
            row["ks"][name] = {
                "k": k, "tok_s": side["rate"], "rates": side["rates"], "work": side["work"],
                "seconds": side["seconds"], "ratio_to_k0": _per_pair(side["rates"],
                                                                     base["rates"]),
                "tally": merge_tallies([o["tally"] for o in side["outputs"]]),
                "same_tokens_as_k0": all(o["tokens"] == reference for o in runs),
                "load_1min": _side_loads(r, name),
            }
    del sides, program
    gc.collect()
    jax.clear_caches()


def measure_demo(cfg, params, prompts: list[list[int]], s: Settings, drafter=None) -> dict:
    """Every (B, variant) of the demo part, in two groups (see REPEAT); `prompts` are token
    ids, at least max(B) of them; `drafter`: the `LoadedDrafter` of the DFlash variants
    (default: the shipped one)."""
    max_seq_len = max(map(len, prompts)) + s.new_tokens
    out = {"compile": {}, "batches": {}}
    mtp = [v for v in variants(s) if v[1] == "mtp"]
    _measure_group(cfg, params, prompts, s, mtp, None, out, max_seq_len)
    out["best"] = _best(out["batches"], s)
    if s.dflash_ks:
        if drafter is None:
            from ninfer_jax.loader import DEFAULT_DRAFTER, load_drafter

            drafter = load_drafter(DEFAULT_DRAFTER)
        group = [("K=0" + REPEAT, "mtp", 0)]
        if "b1" in out["best"].get("mtp", {}):
            k = out["best"]["mtp"]["b1"]["k"]
            group.append((f"K={k}" + REPEAT, "mtp", k))
        group += [v for v in variants(s) if v[1] == "dflash"]
        _measure_group(cfg, params, prompts, s, group, drafter, out, max_seq_len)
        out["best"] = _best(out["batches"], s)
    return out


def _best(batches: dict, s: Settings) -> dict:
    """Per method: the K > 0 with the highest median per-pair ratio at B=1, and the one with
    the highest geometric mean of the per-B median ratios (ties: the smaller K); then whether
    DFlash's best at B=1 beats MTP's."""
    out = {}
    for method, ks in (("mtp", [k for k in s.ks if k]), ("dflash", list(s.dflash_ks))):
        names = {k: (f"K={k}" if method == "mtp" else f"dflash K={k}") for k in ks}
        if not ks or any(names[k] not in v["ks"] for v in batches.values() for k in ks):
            continue  # none asked for, or not measured yet (the first group)
        best = {}
        if 1 in batches:
            r = {k: batches[1]["ks"][names[k]]["ratio_to_k0"]["median"] for k in ks}
            k1 = max(ks, key=lambda k: (r[k], -k))
            best["b1"] = {"k": k1, "ratio": batches[1]["ks"][names[k1]]["ratio_to_k0"],
                          "target": TARGET_DEMO_SPEEDUP, "met": r[k1] >= TARGET_DEMO_SPEEDUP}
        geo = {k: math.exp(statistics.fmean(
            math.log(v["ks"][names[k]]["ratio_to_k0"]["median"]) for v in batches.values()))
            for k in ks}
        k_best = max(ks, key=lambda k: (geo[k], -k))
        best["across_b"] = {"k": k_best, "geomean_ratio": geo[k_best], "geomean_by_k": geo}
        out[method] = best
    if "b1" in out.get("mtp", {}) and "b1" in out.get("dflash", {}):
        # Per turn pair of the second group, where MTP's best K took turns with DFlash's.
        row = batches[1]["ks"]
        d = row[f"dflash K={out['dflash']['b1']['k']}"]["rates"]
        m = row[f"K={out['mtp']['b1']['k']}{REPEAT}"]["rates"]
        ratio = _per_pair(d, m)
        out["dflash_over_mtp_b1"] = {"ratio": ratio, "met": ratio["median"] > 1}
    return out


def measure_verify(cfg, params, s: Settings, vocab_size: int, seed: int = 0) -> dict:
    """K=0 against K=medium_k on `cfg` (with MTP weights in `params`): ms per round at each B."""
    import numpy as np

    k = s.medium_k
    total_rounds = s.medium_rounds * (s.warmup + s.medium_reps)
    max_new = 1 + total_rounds * (k + 1)
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, vocab_size, (max(s.medium_batches), PROMPT_LEN)).tolist()
    out = {"k": k, "rounds_per_turn": s.medium_rounds, "compile": {}, "batches": {}}
    sides = []
    for kk in (0, k):
        progress(f"medium: compiling K={kk} (B = 1..{max(s.medium_batches)})")
        pcfg = program_config(kk, max(s.medium_batches), PROMPT_LEN + max_new, PROMPT_LEN)
        program, out["compile"][kk] = build_program(cfg, params, pcfg)
        sides.append(LocalSide(f"K={kk}", RoundSide(program, kk, s.medium_rounds,
                                                   total_rounds)))
    for b in s.medium_batches:
        progress(f"medium: B={b}, K=0 and K={k} in turn")
        r = alternate(sides, f"medium_b{b}", {"prompts": prompts[:b]}, reps=s.medium_reps,
                      warmup=s.warmup)
        plain, spec = r["sides"]["K=0"], r["sides"][f"K={k}"]
        ms = {n: spread([1000 / x for x in r["sides"][n]["rates"]]) for n in r["sides"]}
        a, c = plain["outputs"][-1]["tokens"], spec["outputs"][-1]["tokens"]
        common = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
                  for p, q in zip(a, c)]
        out["batches"][b] = {
            "order": r["order"], "round_ms": ms,
            "verify_over_decode": _per_pair(plain["rates"], spec["rates"]),
            "tally": merge_tallies([o["tally"] for o in spec["outputs"]]),
            "k0_tokens_per_row": len(a[0]), "common_prefix_per_row": common,
            "load_1min": r["load_1min"], "load": r["load"]}
    if 1 in out["batches"]:
        got = out["batches"][1]["verify_over_decode"]["median"]
        out["target_b1"] = {"need": TARGET_MEDIUM_VERIFY, "got": got,
                            "met": got <= TARGET_MEDIUM_VERIFY}
    return out


def format_table(result: dict) -> str:
    s, demo = result["settings"], result["demo"]
    comp = ", ".join(f"{k} {c['wall_s']:.1f} s" for k, c in demo["compile"].items())
    lines = [(f"demo model: {s['new_tokens']} tokens per row (the first from the untimed "
              f"prefill), greedy, {s['warmup']} warm-up + {s['reps']} turns per K in turn; "
              f"compile (B = 1..{max(s['batches'])}): {comp}"),
             (f"{'B':>3}{'variant':>13}{'tok/s':>26}{'/K=0 per pair':>20}"
              f"{'tok/row-round':>15}  {'acceptance by draft position':<30}{'same as K=0':>12}"
              f"{'load 1-min':>12}")]
    for b, row in demo["batches"].items():
        for name, v in row["ks"].items():
            acc = " ".join("-" if a is None else f"{a:.2f}"
                           for a in v["tally"]["acceptance_by_position"]) or "-"
            ratio = fmt_spread(v["ratio_to_k0"], 2) if v["k"] else "1"
            load = v["load_1min"]
            lines.append(f"{b:>3}{name:>13}{fmt_spread(v['tok_s']):>26}{ratio:>20}"
                         f"{v['tally']['mean_committed_per_row_round']:>15.2f}  {acc:<30}"
                         f"{'yes' if v['same_tokens_as_k0'] else 'NO':>12}"
                         f"{load['min']:>6.1f}-{load['max']:<5.1f}")
    for method, best in demo["best"].items():
        if method == "dflash_over_mtp_b1":
            continue
        label = "K=" if method == "mtp" else "dflash K="
        if "b1" in best:
            b1 = best["b1"]
            lines.append(f"best {method} K at B=1: {label}{b1['k']}, "
                         f"{fmt_spread(b1['ratio'], 2)} x K=0 per pair")
            if method == "mtp":
                lines.append(f"target best K >= {b1['target']}x K=0 at B=1 (embedded model): "
                             f"{b1['ratio']['median']:.2f} ({'met' if b1['met'] else 'NOT met'})")
        geo = ", ".join(f"{label}{k} {v:.2f}" for k, v in best["across_b"]["geomean_by_k"].items())
        lines.append(f"best {method} K across B (geometric mean of the median ratios): "
                     f"{label}{best['across_b']['k']} ({geo})")
    if "dflash_over_mtp_b1" in demo["best"]:
        t = demo["best"]["dflash_over_mtp_b1"]
        lines.append(f"target DFlash's best K above MTP's best K at B=1 (per turn pair): "
                     f"{fmt_spread(t['ratio'], 2)}x ({'met' if t['met'] else 'NOT met'})")
    if "medium" in result:
        m = result["medium"]
        comp = ", ".join(f"K={k} {c['wall_s']:.1f} s" for k, c in m["compile"].items())
        spec = f"K={m['k']}"
        lines += ["", (f"MEDIUM (random fp32 weights, 1 MTP layer): {m['rounds_per_turn']} "
                       f"rounds per turn, K=0 and K={m['k']} in turn; compile (B = 1.."
                       f"{max(s['medium_batches'])}): {comp}"),
                  (f"{'B':>3}{'K=0 ms/round':>24}{spec + ' ms/round':>24}"
                   f"{'verify/decode per pair':>26}{'tok/row-round':>15}{'agree':>10}"
                   f"{'load 1-min':>12}")]
        for b, v in m["batches"].items():
            ms = v["round_ms"]
            load = v["load_1min"]
            agree = f"{min(v['common_prefix_per_row'])}/{v['k0_tokens_per_row']}"
            lines.append(f"{b:>3}{fmt_spread(ms['K=0'], 0):>24}"
                         f"{fmt_spread(ms[spec], 0):>24}"
                         f"{fmt_spread(v['verify_over_decode'], 2):>26}"
                         f"{v['tally']['mean_committed_per_row_round']:>15.2f}{agree:>10}"
                         f"{load['min']:>6.1f}-{load['max']:<5.1f}")
        if "target_b1" in m:
            t = m["target_b1"]
            lines.append(f"target MEDIUM verify (K={m['k']}) step <= {t['need']}x a decode step "
                         f"at B=1: {t['got']:.2f} ({'met' if t['met'] else 'NOT met'})")
    lines.append("rates: median [min-max] over the turns; ratios per turn pair, to K=0 in the "
                 "first group and to K=0' in the second (K=0', K=k' and dflash turned "
                 "together); agree: leading tokens K=0 and K>0 share (worst row) / K=0's "
                 "tokens per row")
    return "\n".join(lines)


def run(out_dir: str) -> dict:
    del out_dir  # bench.py writes the JSON; the table is printed
    s = Settings.from_env()
    import jax

    from ninfer_jax.compile_cache import enable_persistent_cache
    from ninfer_jax.frontend import Frontend
    from ninfer_jax.loader import load_model

    enable_persistent_cache()
    start, load_start = time.perf_counter(), os.getloadavg()
    progress(f"settings {s}")
    loaded = load_model(None, verify=False)
    frontend = Frontend.load(loaded.path)
    prompts = [list(frontend.prepare(prompt=p).token_ids) for p in PROMPTS]
    result = {"settings": dataclasses.asdict(s), "date": time.strftime("%Y-%m-%d %H:%M"),
              "jax": jax.__version__, "cpu_count": os.cpu_count(),
              "demo": measure_demo(loaded.config, loaded.params, prompts, s)}
    if s.medium:
        from configs.models import MEDIUM
        from ninfer_jax.models.qwen3_6.weights import init_params

        cfg = dataclasses.replace(MEDIUM, mtp_num_layers=1)
        params = init_params(cfg, jax.random.key(0), num_mtp_layers=1)
        result["medium"] = measure_verify(cfg, params, s, cfg.vocab_size)
    result.update(load_average_start=load_start, load_average_end=os.getloadavg(),
                  wall_s=time.perf_counter() - start)
    result["table"] = format_table(result)
    print(result["table"])
    return result
