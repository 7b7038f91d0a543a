"""`ninfer score` on the demo model with 1 process against 2 processes (jax.distributed).

    from scripts.benchmarks import scoring_procs
    report = scoring_procs.run(out_dir, records=400, reps=3)

One JSONL job (`records` TinyStories sentences, or generated text without ../shared/data) is
scored by fresh `ninfer score` subprocesses: 1 process, then 2 processes on a loopback
coordinator, alternating 1, 2, 1, 2, ... (`reps` turns each, after one untimed warm-up turn each
that fills the compilation cache). A turn is timed from the start of the first process to the
exit of the last, so it includes start-up (imports, model load, the window executable: processes
other than 0 compile it at every start, since jax keys the CPU cache by device and writes it from
process 0 only) and, for 2 processes, the merge. Every output must be byte-identical to the first
1-process output. Reported: each side's median, min and max seconds, records/s and tokens/s of
the median, the per-pair ratio (1-process seconds over 2-process seconds: > 1 means 2 processes
are faster), `os.getloadavg()` before and after each turn, and a markdown table.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import socket
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[2]
DATA = REPO.parent / "shared" / "data" / "tinystories" / "valid_head_cased.txt"
CLI = [sys.executable, "-c", "from ninfer_jax.gateway.cli import run; run()", "score"]
FLAGS = ["--max_len=128", "--max_batch_tokens=1024", "--chunk_records=16"]
TIMEOUT_S = 900


def _sentences(n: int) -> list[str]:
    if DATA.is_file():
        text = DATA.read_text(encoding="utf-8")
        found = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if 10 < len(s.strip()) < 300]
    else:
        found = []
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "saw", "big", "dog"]
    while len(found) < n:  # generated text beyond the data file
        i = len(found)
        found.append(" ".join(words[(i * 7 + k * 3) % len(words)] for k in range(8 + i % 20)))
    return found[:n]


def _port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _turn(src: pathlib.Path, out: pathlib.Path, num_processes: int) -> dict:
    """One fresh job (no earlier output) with `num_processes` processes, timed."""
    for path in (out, out.with_name(out.name + ".job.json")):
        path.unlink(missing_ok=True)
    shutil.rmtree(out.with_name(out.name + ".parts"), ignore_errors=True)
    extra = [[]] if num_processes == 1 else [
        [f"--num_processes={num_processes}", f"--process_id={p}", f"--coordinator=127.0.0.1:{port}"]
        for port in [_port()] for p in range(num_processes)]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    procs = [subprocess.Popen([*CLI, *FLAGS, f"--input={src}", f"--output={out}", *args],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for args in extra]
    errs, failed = [], None
    try:
        for p in procs:
            errs.append(p.communicate(timeout=TIMEOUT_S)[1])
            if p.returncode != 0 and failed is None:
                failed = f"exit {p.returncode}: {errs[-1][-2000:]}"
    except subprocess.TimeoutExpired:
        failed = f"timed out after {TIMEOUT_S}s"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    seconds = time.perf_counter() - start
    if failed:
        raise RuntimeError(f"ninfer score with {num_processes} process(es) failed: {failed}")
    return {"processes": num_processes, "seconds": seconds, "load_before": load_before,
            "load_after": os.getloadavg()[0], "output": out.read_bytes()}


def _side(turns: list[dict], records: int, tokens: int) -> dict:
    seconds = [t["seconds"] for t in turns]
    median = statistics.median(seconds)
    return {"seconds": seconds, "median_s": median, "min_s": min(seconds), "max_s": max(seconds),
            "records_per_s": records / median, "tokens_per_s": tokens / median,
            "load": [(t["load_before"], t["load_after"]) for t in turns]}


def run(out_dir: str, records: int = 400, reps: int = 3) -> dict:
    """Times the job with 1 and 2 processes in turn (see the module docstring); returns the
    figures and a markdown table under "table"."""
    work = pathlib.Path(out_dir) / "scoring_procs"
    work.mkdir(parents=True, exist_ok=True)
    src = work / "in.jsonl"
    src.write_text("".join(json.dumps({"text": s}) + "\n" for s in _sentences(records)))
    out = work / "out.jsonl"
    reference = _turn(src, out, 1)["output"]  # warm-up of both sides, untimed
    warm_two = _turn(src, out, 2)["output"]
    tokens = sum(json.loads(line).get("num_tokens", 0) for line in reference.splitlines())
    turns = {1: [], 2: []}
    order, identical = [], warm_two == reference
    for _ in range(reps):
        for n in (1, 2):
            turn = _turn(src, out, n)
            identical &= turn.pop("output") == reference
            turns[n].append(turn)
            order.append(n)
    one, two = (_side(turns[n], records, tokens) for n in (1, 2))
    ratios = [a["seconds"] / b["seconds"] for a, b in zip(turns[1], turns[2])]
    report = {
        "records": records, "tokens": tokens, "reps": reps, "flags": FLAGS, "order": order,
        "identical_outputs": identical, "one_process": one, "two_processes": two,
        "speedup_per_pair": {"median": statistics.median(ratios), "min": min(ratios),
                             "max": max(ratios), "values": ratios},
    }
    loads = [x for side in (one, two) for pair in side["load"] for x in pair]
    report["table"] = "\n".join([
        ("| processes | s median [min-max] | records/s | tokens/s | 1-proc s / 2-proc s per "
         "pair | identical | 1-min load |"),
        "|---|---|---|---|---|---|---|",
        *(f"| {n} | {s['median_s']:.2f} [{s['min_s']:.2f}-{s['max_s']:.2f}] | "
          f"{s['records_per_s']:.1f} | {s['tokens_per_s']:.0f} | "
          + (f"{report['speedup_per_pair']['median']:.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
             if n == 2 else "-")
          + f" | {'yes' if identical else 'NO'} | {min(loads):.1f}-{max(loads):.1f} |"
          for n, s in ((1, one), (2, two))),
    ])
    shutil.rmtree(work, ignore_errors=True)
    return report
