"""BENCHMARKS.md, generated from the measured results in `results/*.json`.

    python -m scripts.benchmarks_table [--results=results] [--out=BENCHMARKS.md]

A results file is one suite's run (or one day's runs) and takes one of two forms:

- rows: a list of `{"config": str, "ours", "against", "ratio", "change_pct", "unit": str, ...}`
  with any of the four figures present. A figure is a number, `{"median", "min", "max"}`,
  `{"min", "max"}` or a list of those; other keys of a row are kept in the file, not shown. The
  file names its `suite` and `date`, and may say what the figures are (`legend`), how it was run
  (`command`, `settings`, `machine`, `code`), its `target`, and `source` (with the
  `source_commit` that holds the record) when it was transcribed from a written record rather
  than written by the suite.
- what a suite's `run()` returned (`scripts/bench.py --out=DIR` writes `DIR/SUITE.json`), read
  by this module's extractor for that suite (`EXTRACTORS`), the suite and date taken from a file
  name `SUITE_YYYY-MM-DD[_TAG].json` when the JSON does not hold them.

A file in neither form, or a figure of an unknown shape, is an error naming the file: a result
is never left out of the table quietly. The output is one table per suite (date, configuration,
ours, what it was measured against, their ratio) with one line per file saying what its columns
mean. This module reads JSON only (no jax).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import re
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMAND = "python -m scripts.benchmarks_table"

_FILE_NAME = re.compile(r"^(?P<suite>[a-z_]+?)_(?P<date>\d{4}-\d{2}-\d{2})(?:_.*)?$")
_SPREAD_KEYS = {"median", "min", "max", "n"}


class ResultsError(ValueError):
    """A results file this module cannot read; the message names the file."""


@dataclasses.dataclass(frozen=True)
class Row:
    config: str
    ours: Any = None  # a figure (see the module docstring) or None
    against: Any = None
    ratio: Any = None
    change_pct: float | None = None  # shown in the ratio column as a signed percentage
    unit: str = ""  # of ours and against


@dataclasses.dataclass(frozen=True)
class ResultSet:
    path: pathlib.Path
    suite: str
    date: str  # YYYY-MM-DD
    rows: tuple[Row, ...]
    legend: str  # one line: what the columns mean, how it was run, its target


# --- figures -----------------------------------------------------------------------------


def _decimals(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"not a number: {x!r}")
    text = repr(x)
    return len(text.split(".")[1]) if "." in text and "e" not in text else 0


def _numbers(xs: list) -> list[str]:
    """Numbers shown together (a spread, a list) with as many decimals as the most precise one,
    so 1.07 [0.90-1.10] reads as it was recorded."""
    digits = max(_decimals(x) for x in xs)
    return [f"{x:,.{digits}f}" for x in xs]


def format_figure(x: Any) -> str:
    """One figure as the table shows it: `12.5`, `3.18 [1.94-4.90]`, `39-57`, `0.85, 0.70`."""
    if x is None:
        return "-"
    if isinstance(x, list):
        if not x:
            raise TypeError("an empty list of figures")
        if all(not isinstance(v, (dict, list)) for v in x):
            return ", ".join(_numbers(x))
        return ", ".join(format_figure(v) for v in x)
    if isinstance(x, dict):
        if not set(x) <= _SPREAD_KEYS or not {"min", "max"} <= set(x):
            raise TypeError(f"a figure's keys must be median/min/max[/n], got {sorted(x)}")
        if "median" in x:
            median, lo, hi = _numbers([x["median"], x["min"], x["max"]])
            return f"{median} [{lo}-{hi}]"
        lo, hi = _numbers([x["min"], x["max"]])
        return f"{lo}-{hi}"
    return _numbers([x])[0]


def _cell(x: Any, unit: str) -> str:
    text = format_figure(x)
    return f"{text} {unit}" if unit and x is not None else text


def _ratio_cell(row: Row) -> str:
    if row.change_pct is not None:
        return f"{row.change_pct:+}%"
    return format_figure(row.ratio)


def _rounded(spread: dict, digits: int) -> dict:
    return {k: round(spread[k], digits) for k in ("median", "min", "max")}


# --- the two forms ------------------------------------------------------------------------


def _row_from_json(raw: dict) -> Row:
    if not isinstance(raw.get("config"), str):
        raise TypeError(f"a row needs a config string: {raw!r}")
    row = Row(config=raw["config"], ours=raw.get("ours"), against=raw.get("against"),
              ratio=raw.get("ratio"), change_pct=raw.get("change_pct"),
              unit=raw.get("unit", ""))
    if all(v is None for v in (row.ours, row.against, row.ratio, row.change_pct)):
        raise TypeError(f"row {row.config!r} has no figure")
    for figure in (row.ours, row.against, row.ratio):
        format_figure(figure)  # raises on an unknown shape
    return row


def _legend_of(data: dict) -> str:
    parts = []
    if data.get("command"):
        parts.append(f"`{data['command']}`")
    for key in ("settings", "machine", "code"):
        if data.get(key):
            parts.append(str(data[key]))
    legend = data.get("legend") or {}
    parts.extend(f"{k}: {v}" for k, v in legend.items())
    if data.get("target"):
        parts.append(f"target: {data['target']}")
    if data.get("source"):
        commit = data.get("source_commit")
        parts.append(f"{data['source']} at {commit[:7]}" if commit else data["source"])
    return "; ".join(parts)


# Units of the scoring suite's tasks (scripts/benchmarks/scoring.py, UNITS).
_SCORING_UNITS = {"rolling": "tok/s", "choice": "pairs/s", "short": "rec/s"}


def _scoring(data: dict) -> tuple[list[Row], str]:
    rows = []
    for result in data["results"]:
        for task, t in result["tasks"].items():
            m = t["measurement"]
            rows.append(Row(
                config=f"{result['config']} {task}, {t['sequences']} sequences: vs transformers",
                ours=_rounded(m["sides"]["ours"]["rate"], 1),
                against=_rounded(m["sides"]["transformers"]["rate"], 1),
                ratio=_rounded(m["ratios"]["ours/transformers"], 2),
                unit=_SCORING_UNITS[task]))
            for side, what in (("baseline", "vs the code at {commit}"),
                               ("matmul_floor", "vs the matmul floor (XLA dots alone)")):
                if side in m["sides"]:
                    commit = result.get("baseline", {}).get("commit", "")
                    rows.append(Row(
                        config=f"{result['config']} {task}, {t['sequences']} sequences: "
                               + what.format(commit=commit),
                        ours=_rounded(m["sides"]["ours"]["rate"], 1),
                        against=_rounded(m["sides"][side]["rate"], 1),
                        ratio=_rounded(m["ratios"][f"ours/{side}"], 2),
                        unit=_SCORING_UNITS[task]))
    for key, config, unit in (
            ("lm_eval", "lm-eval simple_evaluate, {n} docs on demo: vs the plain path", "docs/s"),
            ("cli", "ninfer score, {n} short records on demo: vs the old defaults", "rec/s")):
        part = data.get(key)
        if not part:
            continue
        m = part["measurement"]
        rows.append(Row(config=config.format(n=part.get("docs") or part.get("records")),
                        ours=_rounded(m["sides"]["ours"]["rate"], 1),
                        against=_rounded(m["sides"]["ours_plain"]["rate"], 1),
                        ratio=_rounded(m["ratios"]["ours/ours_plain"], 2), unit=unit))
    legend = ("`python scripts/bench.py --suite=scoring`; ours: CausalScoreCore, median "
              "[min-max] over the repetitions; against: transformers (forward + log_softmax + "
              "gather, padded batches of 16), our plain path (pack and shared contexts off), "
              "an earlier commit's code (BENCH_SCORING_BASELINE) or the matmul floor; "
              "ratio: per round; written by the suite, its printed table in `table`")
    return rows, legend


def _spec_policy(data: dict) -> tuple[list[Row], str]:
    """Decode tok/s where the run has it (the targets' measure); older runs timed the turn
    only."""
    method = data["settings"]["method"]
    rows, met = [], []
    decode = False
    for b, batch in sorted(data["measure"]["batches"].items(), key=lambda kv: int(kv[0])):
        sides, policy = batch["sides"], batch["policy"]
        decode = "decode_tok_s" in sides["off"]
        rate, over = ("decode_tok_s", "decode_over_off") if decode else ("tok_s", "over_off")
        off = _rounded(sides["off"][rate], 1)
        for name in ("policy", policy["best_fixed"]):
            label = name if name == "policy" else f"best fixed {name}"
            rows.append(Row(config=f"{method} B={b}: {label} vs off",
                            ours=_rounded(sides[name][rate], 1), against=off,
                            ratio=_rounded(sides[name][over], 2), unit="tok/s"))
        if policy.get("replicas", 1) > 1:  # BENCH_SPECPOL_REPLICAS: what the targets are on
            n = policy["replicas"]
            rows.append(Row(config=f"{method} B={b}: policy vs off, {n} processes a side",
                            ratio=_rounded(policy["decode_over_off"], 2)))
            if "fixed_over_off" in policy:  # the fixed Ks as replicated too
                best = policy["best_fixed"]
                rows.append(Row(config=f"{method} B={b}: best fixed {best} vs off, {n} "
                                       f"processes a side",
                                ratio=_rounded(policy["fixed_over_off"][best], 2)))
            rows.append(Row(config=f"{method} B={b}: off vs off, the same code in another "
                                   f"process", ratio=_rounded(batch["replica_spread"]["off"], 3)))
        if "decode_over_own_off" in policy:  # the policy's process, requests drafting nothing
            rows.append(Row(config=f"{method} B={b}: policy vs speculative=\"off\" requests "
                                   f"of its own process", ratio=_rounded(
                                       policy["decode_over_own_off"], 2)))
            rows.append(Row(config=f"{method} B={b}: those requests vs off",
                            ratio=_rounded(policy["own_off_over_off"], 2)))
        rows.append(Row(config=f"{method} B={b}: policy vs the best fixed {policy['best_fixed']}",
                        ratio=_rounded(policy["decode_over_best_fixed" if decode
                                              else "over_best_fixed"], 2)))
        if decode:
            rows.append(Row(config=f"{method} B={b}: policy vs off, the turn (prefills too)",
                            ours=_rounded(sides["policy"]["tok_s"], 1),
                            against=_rounded(sides["off"]["tok_s"], 1),
                            ratio=_rounded(sides["policy"]["over_off"], 2), unit="tok/s"))
        if "off_over_base" in batch:  # BENCH_SPECPOL_BASELINE: a checkout's off in the turns
            rows.append(Row(config=f"{method} B={b}: off vs the baseline checkout's off",
                            ours=_rounded(sides["off"]["tok_s"], 1),
                            against=_rounded(sides["base off"]["tok_s"], 1),
                            ratio=_rounded(batch["off_over_base"], 3), unit="tok/s"))
        if "policy_over_base" in batch:
            rows.append(Row(config=f"{method} B={b}: policy vs the baseline checkout's policy",
                            ours=_rounded(sides["policy"]["tok_s"], 1),
                            against=_rounded(sides["base policy"]["tok_s"], 1),
                            ratio=_rounded(batch["policy_over_base"], 3), unit="tok/s"))
        met.append(f"B={b} {'met' if policy['met'] else 'NOT met'}")
    for b, upkeep in sorted(data["measure"]["upkeep"].items(), key=lambda kv: int(kv[0])):
        rows.append(Row(config=f"{method} B={b}: a round of 0 drafts vs plain decode (Program)",
                        ours=_rounded(upkeep["round_ms"]["policy"], 3),
                        against=_rounded(upkeep["round_ms"]["off"], 3),
                        ratio=_rounded(upkeep["over_off"], 2), unit="ms"))
    from scripts.benchmarks.spec_policy import DEFAULT_KS, Settings

    settings, default = data["settings"], Settings()
    reps = settings["reps"]
    env = "" if reps == default.reps else f"BENCH_SPECPOL_REPS={reps} "
    for var, key, usual in (("KS", "ks", DEFAULT_KS[method]),
                            ("BATCHES", "batches", default.batches)):
        if tuple(settings.get(key, usual)) != tuple(usual):
            env += f"BENCH_SPECPOL_{var}={','.join(map(str, settings[key]))} "
    if settings.get("replicas", default.replicas) != default.replicas:
        env += f"BENCH_SPECPOL_REPLICAS={settings['replicas']} "
    if settings.get("baseline"):  # a worktree of the commit it was run against
        env += "BENCH_SPECPOL_BASELINE=DIR "
    measure = ("decode tok/s (each request's tokens after its first over its first to its "
               "end, summed)" if decode else "tok/s (submit to the last result)")
    legend = (f"`{env}BENCH_SPECPOL_METHOD={method} python scripts/bench.py "
              f"--suite=spec_policy`; Engines on the embedded model, each in its own process, "
              f"in turns ({reps} each); {measure}; ours: the "
              "draft policy (or the best fixed K), median [min-max] over turns; against: no "
              "speculation; ratio: per turn pair; target: policy >= 0.97x off and >= 0.9x the "
              f"best fixed K ({', '.join(met)}); written by the suite")
    return rows, legend


def _engine(data: dict) -> tuple[list[Row], str]:
    rows = []
    for case, level in data["comparison"]["levels"].items():
        host = level["host"]["us_per_round"]["median"]
        rows.append(Row(config=f"{case}: Engine vs its Program, C={level['concurrency']} "
                               f"{level['sampling']} (host {host:.0f} us/round)",
                        ours=_rounded(level["sides"]["engine"]["rate"], 1),
                        against=_rounded(level["sides"]["program"]["rate"], 1),
                        ratio=_rounded(level["ratios"]["engine/program"], 2), unit="tok/s"))
    job = data.get("main_job")
    if job:
        cold, warm = job["cold"], job["warm"]
        rows.append(Row(config="main job warm: streamed vs the Program's B=1 sampled round",
                        ours=_rounded(warm["streamed_tok_s"], 1),
                        against=_rounded(job["program_round_tok_s"], 1),
                        ratio=_rounded(job["ratio"], 2), unit="tok/s"))
        rows.append(Row(config=f"main job warm: first token (exit "
                               f"{warm['exit_after_last_s']['max']:.2f} s after the last, most)",
                        ours=_rounded(warm["first_token_s"], 2), unit="s"))
        rows.append(Row(config=f"main job cold: first token ({cold['tokens']} tokens in "
                               f"{cold['exit_s']:.1f} s, exit {cold['exit_after_last_s']:.2f} s "
                               "after the last)", ours=round(cold["first_token_s"], 2), unit="s"))
    legend = ("`python scripts/bench.py --suite=engine`; ours: `Engine.open` on the embedded "
              "model (C requests at once), median [min-max] over repetitions; against: its own "
              "Program driven without an Engine, in the same process, in turn; ratio: per "
              "repetition; main job: `ninfer generate` streamed, as a subprocess; targets: "
              "Engine/Program >= 0.9 (C = 1, 8), >= 0.85 sampled, streamed/Program >= 0.8, exit "
              "<= 0.5 s after the last token, cold first token <= 8 s; written by the suite")
    return rows, legend


# A suite whose run() result is stored as it is: how its rows and legend are read.
EXTRACTORS: dict[str, Callable[[dict], tuple[list[Row], str]]] = {
    "engine": _engine,
    "scoring": _scoring,
    "spec_policy": _spec_policy,
}


def read_result(path: pathlib.Path) -> ResultSet:
    """One results file as rows; raises ResultsError naming the file if it cannot."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise TypeError("not a JSON object")
        name = _FILE_NAME.match(path.stem)
        suite = data.get("suite") or (name and name["suite"])
        date = str(data.get("date") or (name and name["date"]) or "")[:10]
        if not suite or not re.fullmatch(r"\d{4}-\d{2}-\d{2}", date):
            raise TypeError("no suite and date: give them in the JSON or the file name "
                            "(SUITE_YYYY-MM-DD[_TAG].json)")
        if "rows" in data:
            rows = [_row_from_json(r) for r in data["rows"]]
            legend = _legend_of(data)
        elif suite in EXTRACTORS:
            rows, legend = EXTRACTORS[suite](data)
        else:
            raise TypeError(f"no rows, and no extractor for suite {suite!r}")
        if not rows:
            raise TypeError("no rows")
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise ResultsError(f"{path.name}: {type(e).__name__}: {e}") from e
    return ResultSet(path=path, suite=suite, date=date, rows=tuple(rows), legend=legend)


def read_results(results_dir: pathlib.Path) -> list[ResultSet]:
    paths = sorted(results_dir.glob("*.json"))
    if not paths:
        raise ResultsError(f"no results files in {results_dir}")
    return [read_result(p) for p in paths]


# --- the markdown -------------------------------------------------------------------------


def _md(text: str) -> str:
    return text.replace("|", "\\|")


def render(results_dir: pathlib.Path) -> str:
    sets = read_results(results_dir)
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{COMMAND}` from `results/*.json`; edit those files, not this one.",
        ("Figures are median [min-max] where a run recorded a spread. A ratio is the one the run "
         "reported (per turn pair where the suite alternated the sides); the line under each "
         "table says which way it reads. Each run's settings, load and other figures are in its "
         "JSON file. How to run each suite: WORKSPACE.md, \"Benchmarks\"."),
    ]
    for suite in sorted({s.suite for s in sets}):
        members = sorted((s for s in sets if s.suite == suite), key=lambda s: (s.date, s.path.name))
        lines += ["", f"## {suite}", "", "| date | configuration | ours | against | ratio |",
                  "|---|---|---|---|---|"]
        for s in members:
            for r in s.rows:
                lines.append(f"| {s.date} | {_md(r.config)} | {_md(_cell(r.ours, r.unit))} | "
                             f"{_md(_cell(r.against, r.unit))} | {_md(_ratio_cell(r))} |")
        lines.append("")
        lines += [f"- `results/{s.path.name}`: {s.legend}" for s in members]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    # argparse, not absl flags: this module is imported by tests beside the CLI's flags
    parser = argparse.ArgumentParser(description="BENCHMARKS.md from results/*.json")
    parser.add_argument("--results", default=str(ROOT / "results"),
                        help="folder of results JSON files")
    parser.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"),
                        help="the markdown file to write")
    args = parser.parse_args(argv)
    text = render(pathlib.Path(args.results))
    pathlib.Path(args.out).write_text(text)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
