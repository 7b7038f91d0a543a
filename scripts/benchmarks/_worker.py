"""The worker side of the ABAB harness (`_abab.py`): a JSON-lines loop over stdin/stdout.

A worker module defines a `BenchWorker` subclass and ends with `serve(MyWorker())`. The parent
sends one JSON object per line and reads one reply per line:

    {"op": "setup", "args": {...}}                    -> worker.setup(args)
    {"op": "prepare", "name": M, "args": {...}}       -> worker.prepare(M, args)   (untimed)
    {"op": "rep", "name": M}                          -> worker.rep(M)             (timed here)
    {"op": "finish", "name": M}                       -> worker.finish(M)
    {"op": "exit"}                                    -> reply, then the process exits 0

Replies are `{"ok": true, "result": ...}` or `{"ok": false, "error": "<traceback>"}`. `rep`
returns `{"seconds": s, "work": n, "outputs": ...}`: the seconds of its own work measured with
`time.perf_counter`, the units of work done in them (tokens), and whatever the parent needs to
check that the engines agree. The protocol owns file descriptor 1: everything else the process
prints to stdout (libraries do) is sent to stderr, which the parent passes through.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any


class BenchWorker:
    """One engine in its own process. Subclasses implement `setup` and `rep`."""

    def setup(self, args: dict) -> dict:
        """Loads the model and compiles; the parent reports its wall time as set-up time."""
        raise NotImplementedError

    def prepare(self, name: str, args: dict) -> Any:
        """Untimed state for measurement `name` (sequences admitted and prefilled, ...)."""
        return None

    def rep(self, name: str) -> dict:
        """One timed repetition of measurement `name`: {"seconds", "work", "outputs"}."""
        raise NotImplementedError

    def finish(self, name: str) -> Any:
        """Releases what `prepare` built."""
        return None


def timed(fn: Callable[[], Any], work: float) -> dict:
    """Runs fn() under time.perf_counter: {"seconds", "work", "outputs": fn's return value}."""
    start = time.perf_counter()
    outputs = fn()
    return {"seconds": time.perf_counter() - start, "work": work, "outputs": outputs}


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):  # numpy arrays and scalars, torch tensors
        return value.tolist()
    raise TypeError(f"cannot send a {type(value).__name__} to the parent")


def _dispatch(worker: BenchWorker, msg: dict) -> Any:
    op = msg.get("op")
    if op == "setup":
        return worker.setup(msg.get("args", {}))
    if op == "prepare":
        return worker.prepare(msg["name"], msg.get("args", {}))
    if op == "rep":
        return worker.rep(msg["name"])
    if op == "finish":
        return worker.finish(msg["name"])
    if op == "exit":
        return None
    raise ValueError(f"unknown op {op!r}; known: setup, prepare, rep, finish, exit")


def serve(worker: BenchWorker) -> None:
    """Answers the parent's requests until `exit` or the end of stdin."""
    sys.stdout.flush()
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from any library now land on stderr, not in the protocol
    for line in sys.stdin:
        try:
            msg = json.loads(line)
            reply = {"ok": True, "result": _dispatch(worker, msg)}
            text = json.dumps(reply, default=_jsonable)
        except Exception:  # noqa: BLE001 - any failure is the parent's to report; keep answering
            error = traceback.format_exc()
            print(error, file=sys.stderr, flush=True)
            msg, text = {}, json.dumps({"ok": False, "error": error})
        protocol.write(text + "\n")
        protocol.flush()
        if msg.get("op") == "exit":
            break
    protocol.close()
