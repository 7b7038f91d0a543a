"""A fake benchmark worker: each repetition sleeps `sleep_s` and reports scripted seconds.

setup args: {"sleep_s": float, "seconds": [float, ...], "work": float}. Repetition i (warm-up
ones included) reports seconds[i], so the harness's medians and ratios are known exactly, and
outputs {"pid", "start", "end"} (time.monotonic, comparable across processes) so a test can see
the order the repetitions really ran in. Every repetition also prints to stdout, which must not
disturb the protocol.
"""

from __future__ import annotations

import os
import time

from scripts.benchmarks._worker import BenchWorker, serve


class Scripted(BenchWorker):
    def setup(self, args: dict) -> dict:
        self.sleep_s, self.seconds, self.work = args["sleep_s"], args["seconds"], args["work"]
        self.count = 0
        return {"pid": os.getpid()}

    def prepare(self, name: str, args: dict) -> dict:
        return {"name": name, "args": args}

    def rep(self, name: str) -> dict:
        start = time.monotonic()
        time.sleep(self.sleep_s)
        print(f"stray stdout from {name} repetition {self.count}", flush=True)
        seconds = self.seconds[self.count]
        self.count += 1
        return {"seconds": seconds, "work": self.work,
                "outputs": {"pid": os.getpid(), "start": start, "end": time.monotonic()}}


if __name__ == "__main__":
    serve(Scripted())
