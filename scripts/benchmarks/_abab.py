"""The ABAB harness: engines in their own long-lived processes, taking turns, medians and spread.

Why: an engine timed in the same process right after another one is not timed alone (torch
after XLA:CPU ran 5-10x slower, DESIGN §15). So every suite that compares engines runs each
one as a worker subprocess (`python -m <module>`, the loop in `_worker.py`) and alternates
repetitions between them, A B A B ..., so that both see the same machine load.

    with Worker("ours", "scripts.benchmarks.workers.program_jax") as a, \\
            Worker("transformers", "scripts.benchmarks.workers.program_hf") as b:
        a.setup({...}); b.setup({...})            # load + compile, timed but not a measurement
        r = alternate([a, b], "decode_b1", {...}, reps=5)

`alternate` also takes in-process sides (`LocalSide`) for comparisons inside one process.
A measurement's result holds, per side, the seconds and rates (work / seconds) of every
repetition with their median, min and max; per other side, the per-pair ratio (the first
side's rate over that side's, round by round, key "first/other" in "ratios") with its median,
min and max; the order the repetitions ran in; the
1/5/15-minute load average before and after each repetition; and the sides' outputs, for the
suite to check agreement.

A worker that dies is a `WorkerError` carrying its exit status and the tail of its stderr; one
that does not answer within its timeout is killed and reported the same way. Nothing here waits
without a timeout. Worker stderr is passed through to ours, each line prefixed with its name.
"""

from __future__ import annotations

import collections
import json
import math
import os
import pathlib
import queue
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol, Self

REPO = pathlib.Path(__file__).resolve().parents[2]
STDERR_TAIL_LINES = 30


class WorkerError(RuntimeError):
    """A worker crashed, timed out, answered with an error or broke the protocol."""


class Side(Protocol):
    name: str

    def prepare(self, name: str, args: dict) -> Any: ...

    def rep(self, name: str) -> dict: ...

    def finish(self, name: str) -> Any: ...


class Worker:
    """One engine as a long-lived subprocess speaking `_worker.py`'s protocol.

    setup_timeout_s bounds `setup` (loading, compiling); timeout_s bounds every other call.
    """

    def __init__(self, name: str, module: str, *, setup_timeout_s: float = 1800.0,
                 timeout_s: float = 600.0, env: dict[str, str] | None = None):
        self.name, self.module = name, module
        self.setup_timeout_s, self.timeout_s = setup_timeout_s, timeout_s
        self.setup_s: float | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=STDERR_TAIL_LINES)
        self._replies: queue.Queue[bytes | None] = queue.Queue()
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", module], cwd=REPO, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env={**os.environ, **(env or {}), "PYTHONPATH": path})
        self._out = threading.Thread(target=self._read_replies, daemon=True)
        self._err = threading.Thread(target=self._pass_stderr, daemon=True)
        self._out.start()
        self._err.start()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _read_replies(self) -> None:
        for line in self._proc.stdout:
            self._replies.put(line)
        self._replies.put(None)

    def _pass_stderr(self) -> None:
        for raw in self._proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self._tail.append(line)
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)

    def _fail(self, what: str) -> WorkerError:
        if self._proc.poll() is not None:
            self._err.join(timeout=5)  # the last lines a dead worker wrote
        tail = "\n".join(self._tail) or "(nothing)"
        return WorkerError(f"worker {self.name!r} ({self.module}, pid {self.pid}) {what}; "
                           f"last lines of its stderr:\n{tail}")

    def call(self, op: str, timeout_s: float | None = None, **fields: Any) -> Any:
        """Sends one request and returns its result; raises WorkerError (never hangs)."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if self._proc.poll() is not None:
            raise self._fail(f"exited with status {self._proc.returncode} before {op!r}")
        try:
            self._proc.stdin.write(json.dumps({"op": op, **fields}).encode() + b"\n")
            self._proc.stdin.flush()
        except BrokenPipeError:
            self._proc.wait(timeout=10)
            raise self._fail(f"exited with status {self._proc.returncode} before {op!r}") \
                from None
        try:
            line = self._replies.get(timeout=timeout_s)
        except queue.Empty:
            self.kill()
            raise self._fail(f"did not answer {op!r} within {timeout_s:g} s and was killed") \
                from None
        if line is None:
            try:
                status = self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
                status = "unknown (it closed stdout; killed)"
            raise self._fail(f"exited with status {status} during {op!r}")
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            raise self._fail(f"answered {op!r} with a line that is not JSON: {line[:200]!r}") \
                from None
        if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
            raise self._fail(f"answered {op!r} without a boolean 'ok': {line[:200]!r}")
        if not reply["ok"]:
            raise self._fail(f"failed {op!r}:\n{reply.get('error')}")
        return reply.get("result")

    def setup(self, args: dict) -> Any:
        """Loads and compiles; the wall time (not a measurement) is kept in `setup_s`."""
        start = time.perf_counter()
        result = self.call("setup", self.setup_timeout_s, args=args)
        self.setup_s = time.perf_counter() - start
        return result

    def prepare(self, name: str, args: dict) -> Any:
        return self.call("prepare", name=name, args=args)

    def rep(self, name: str) -> dict:
        return self.call("rep", name=name)

    def finish(self, name: str) -> Any:
        return self.call("finish", name=name)

    def close(self, timeout_s: float = 60.0) -> None:
        """Asks the worker to exit and waits for status 0; raises WorkerError otherwise."""
        if self._proc.poll() is None:
            self.call("exit", timeout_s)
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise self._fail(f"did not exit within {timeout_s:g} s after 'exit'; killed") \
                    from None
        self._out.join(timeout=5)
        self._err.join(timeout=5)
        if self._proc.returncode != 0:
            raise self._fail(f"exited with status {self._proc.returncode}")

    def kill(self) -> None:
        """Ends the worker at once (its own pid only) and reaps it."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=30)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()
        else:  # the error in flight is the one to report; do not wait on a broken worker
            self.kill()


class LocalSide:
    """An in-process side for `alternate` (both engines ours, one process): an object with the
    BenchWorker methods, called directly."""

    def __init__(self, name: str, impl: Any):
        self.name, self._impl = name, impl

    def prepare(self, name: str, args: dict) -> Any:
        return self._impl.prepare(name, args)

    def rep(self, name: str) -> dict:
        return self._impl.rep(name)

    def finish(self, name: str) -> Any:
        return self._impl.finish(name)


def spread(values: Sequence[float]) -> dict:
    """{"median", "min", "max", "n"} of a non-empty sequence."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def _checked(side: str, rep: Any) -> dict:
    if not isinstance(rep, dict):
        raise WorkerError(f"side {side!r}: a repetition must return a dict, got {rep!r:.100}")
    for key in ("seconds", "work"):
        v = rep.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v <= 0:
            raise WorkerError(f"side {side!r}: repetition field {key!r} must be a finite "
                              f"number > 0, got {v!r:.60}")
    return rep


def alternate(sides: Sequence[Side], name: str, args: dict, *, reps: int,
              warmup: int = 1, serpentine: bool = False, rotate: bool = False) -> dict:
    """Measurement `name` on every side: prepare (untimed), `warmup` untimed repetitions per
    side, then `reps` rounds in which each side runs one repetition in turn (A B A B ...;
    `serpentine`: every other round in the reverse order, A B C C B A A B C ..., so the first
    two sides' repetitions of a round are always next to each other and each runs first half
    the time; `rotate`: round i starts at side i mod N, A B C B C A C A B ..., so each side
    runs in every place of a round equally often and none twice in a row, where the
    serpentine's turnarounds run the end sides twice in a row), then finish. Returns the
    summary described in the module docstring."""
    if reps < 1 or warmup < 0:
        raise ValueError(f"reps must be >= 1 and warmup >= 0, got reps={reps} warmup={warmup}")
    if serpentine and rotate:
        raise ValueError("alternate takes serpentine or rotate, not both")
    names = [s.name for s in sides]
    if len(set(names)) != len(names):
        raise ValueError(f"side names must be distinct, got {names}")
    prepared, warm, prepare_s = {}, {}, {}
    for s in sides:
        start = time.perf_counter()
        prepared[s.name] = s.prepare(name, args)
        prepare_s[s.name] = time.perf_counter() - start
    for s in sides:
        warm[s.name] = [_checked(s.name, s.rep(name)) for _ in range(warmup)]
    runs: dict[str, list[dict]] = {n: [] for n in names}
    order, loads = [], []
    started = time.perf_counter()
    for i in range(reps):
        at = i % len(sides) if rotate else 0
        for s in (sides[::-1] if serpentine and i % 2 else [*sides[at:], *sides[:at]]):
            before = os.getloadavg()
            rep = _checked(s.name, s.rep(name))
            loads.append({"side": s.name, "before": before, "after": os.getloadavg()})
            runs[s.name].append(rep)
            order.append(s.name)
    for s in sides:
        s.finish(name)
    per_side = {}
    for n in names:
        seconds = [r["seconds"] for r in runs[n]]
        rates = [r["work"] / r["seconds"] for r in runs[n]]
        per_side[n] = {
            "seconds": spread(seconds), "rate": spread(rates), "rates": rates,
            "work": runs[n][0]["work"], "prepare_s": prepare_s[n],
            "warmup_s": [r["seconds"] for r in warm[n]],
            "prepared": prepared[n], "warmup_outputs": [r.get("outputs") for r in warm[n]],
            "outputs": [r.get("outputs") for r in runs[n]],
        }
    one_min = [sample[when][0] for sample in loads for when in ("before", "after")]
    result = {"measurement": name, "reps": reps, "warmup": warmup, "order": order,
              "sides": per_side, "wall_s": time.perf_counter() - started,
              "load_1min": spread(one_min), "load": loads}
    first = per_side[names[0]]["rates"]
    result["ratios"] = {f"{names[0]}/{n}": spread([x / y for x, y in
                                                   zip(first, per_side[n]["rates"])])
                        for n in names[1:]}
    return result


def progress(what: str) -> None:
    """A progress line on stdout with the time and the 1-minute load average."""
    print(f"[{time.strftime('%H:%M:%S')} load {os.getloadavg()[0]:.1f}] {what}", flush=True)


def fmt_spread(s: dict, digits: int = 1) -> str:
    """'median [min-max]'."""
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}-{s['max']:.{digits}f}]"


def strip_outputs(result: dict) -> dict:
    """A copy of an `alternate` result without the sides' outputs (for the JSON report)."""
    sides = {n: {k: v for k, v in s.items()
                 if k not in ("prepared", "warmup_outputs", "outputs")}
             for n, s in result["sides"].items()}
    return {**result, "sides": sides}
