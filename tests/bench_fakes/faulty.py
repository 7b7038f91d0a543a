"""A fake benchmark worker that fails on purpose.

setup args: {"fail": "setup" | "crash" | "hang" | "raise" | "bad_seconds", "at_rep": int}.
"setup" dies during setup; the others misbehave at repetition `at_rep` (0-based): "crash"
writes a marker to stderr and exits with status 3, "hang" sleeps for an hour, "raise" raises
an exception (an error reply), "bad_seconds" reports seconds = 0. Earlier repetitions succeed.
"""

from __future__ import annotations

import os
import sys
import time

from scripts.benchmarks._worker import BenchWorker, serve

MARKER = "faulty worker: simulated failure"


class Faulty(BenchWorker):
    def setup(self, args: dict) -> dict:
        self.fail, self.at_rep, self.count = args["fail"], args.get("at_rep", 0), 0
        if self.fail == "setup":
            self._die()
        return {}

    def _die(self) -> None:
        print(MARKER, file=sys.stderr, flush=True)
        os._exit(3)

    def rep(self, name: str) -> dict:
        count, self.count = self.count, self.count + 1
        if count == self.at_rep:
            if self.fail == "crash":
                self._die()
            if self.fail == "hang":
                time.sleep(3600)
            if self.fail == "raise":
                raise RuntimeError(MARKER)
            if self.fail == "bad_seconds":
                return {"seconds": 0.0, "work": 1.0}
        return {"seconds": 0.01, "work": 1.0}


if __name__ == "__main__":
    serve(Faulty())
