"""The demo model's Program B=1 round (decode + commit), for comparing two checkouts in turn.

    for i in 1 2 3 4; do
      PYTHONPATH=/path/to/old python scripts/program_round.py
      PYTHONPATH=/path/to/new python scripts/program_round.py
    done

Each run loads the embedded model, builds a Program (max_concurrency 8), admits one 16-token
prompt and prints the median, min and max over 7 turns of the mean time of 16 rounds, in ms,
and the 1-min load. Runs in turn (ABAB), each checkout in its own process. Uses only the
Program API both old and new checkouts have.
"""

import os
import statistics
import time

from ninfer_jax.compile_cache import enable_persistent_cache
from ninfer_jax.loader import load_model
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.program import Program
from ninfer_jax.sampling_params import SamplingParams


def main() -> None:
    enable_persistent_cache()
    m = load_model()
    p = Program(m.config, m.params,
                ProgramConfig(max_concurrency=8, max_seq_len=512, num_pages=512))
    if hasattr(p, "wait_compiled"):
        p.wait_compiled()
    h = p.materialize(p.plan_admission(16, 400), list(range(10, 26)),
                      SamplingParams(temperature=0.0, max_new_tokens=400))
    while (b := p.prefill(h)) is None:
        pass
    p.commit(b, [1])

    def rounds(n: int) -> None:
        for _ in range(n):
            p.commit(p.decode([h]), [1])

    rounds(16)
    ts = []
    for _ in range(7):
        t = time.perf_counter()
        rounds(16)
        ts.append((time.perf_counter() - t) / 16 * 1e3)
    print(f"round ms median {statistics.median(ts):.3f} min {min(ts):.3f} max {max(ts):.3f} "
          f"load {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
