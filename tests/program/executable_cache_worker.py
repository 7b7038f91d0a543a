"""One process of `test_executable_cache.py` (argument: how many identical Programs to build in
turn, default 1): a tiny dense Program on $NINFER_JAX_CACHE_DIR
(its executables from the executable cache where it holds them), greedy prefill and decode of
two rows, then JSON: the tokens, the cache's counts, the executables built, and whether the
decode steps updated the pools in place (donation: a donated buffer jax could not use is an
error here, as in the test suite)."""

from __future__ import annotations

import json
import sys
import warnings

import jax
import numpy as np

from ninfer_jax.compile_cache import enable_persistent_cache
from ninfer_jax.models.qwen3_6.weights import init_params
from ninfer_jax.program import executable_cache
from ninfer_jax.program.config import ProgramConfig
from ninfer_jax.program.host import GREEDY
from ninfer_jax.program.program import Program
from ninfer_jax.testing import tiny_dense


def main() -> None:
    enable_persistent_cache()
    warnings.filterwarnings("error", message="Some donated buffers were not usable")
    cfg = tiny_dense()
    params = init_params(cfg, jax.random.key(0), np.float32)
    pcfg = ProgramConfig(max_concurrency=2, max_seq_len=64, num_pages=16, page_size=8,
                         prefill_chunk=16)
    for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1):  # the last one decodes
        prog = Program(cfg, params, pcfg)  # a second one: jax's in-memory cache serves it
        prog.wait_compiled()
    handles = []
    for prompt in ([5, 6, 7, 8, 9], [10, 11, 12]):
        h = prog.materialize(prog.plan_admission(len(prompt), 8), prompt, GREEDY)
        while (batch := prog.prefill(h)) is None:
            pass
        prog.commit(batch, [1])
        handles.append(h)
    before = prog.pools.k.unsafe_buffer_pointer()
    for _ in range(6):
        batch = prog.decode(handles)
        prog.commit(batch, [1, 1])
    in_place = prog.pools.k.unsafe_buffer_pointer() == before
    print(json.dumps({"tokens": [prog.tokens(h) for h in handles],
                      "counts": executable_cache.counts,
                      "executables": len(prog.executables.compile_seconds),
                      "donated_in_place": in_place}))
    prog.close()


if __name__ == "__main__":
    main()
